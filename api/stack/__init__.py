"""The local stack: the same code as `swallow serve`, split into processes
with one role each -- `api` (HTTP, chat template, tokenising, detokenising,
the router), `encoder` (media to embeddings in shared memory) and `worker`
(one engine) -- talking over ZeroMQ (``messages.py``), and `stack`, which
starts and supervises them on one machine (``supervisor.py``)."""
