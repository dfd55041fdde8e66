FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY llm_core ./llm_core
COPY api ./api
COPY media ./media
COPY encoders ./encoders
COPY embedding_cache ./embedding_cache
COPY demo ./demo
RUN pip install --no-cache-dir .
ENV SWALLOW_HOME=/models
# The API's HTTP port; workers (ZeroMQ, health) and encoders (ZeroMQ, health and /internal/embeddings).
EXPOSE 8000 7100 7101 7200 7201
ENTRYPOINT ["swallow"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
