"""The demo model's tokenizer: a byte-level BPE trained on the demo world's
language, so its words become single tokens, then grown for the tool and thinking
(BPE merges appended for their words, the markers added as single tokens) without
changing the token ids of the earlier tasks' texts, so a checkpoint trained before
them keeps its embedding rows when fine-tuned."""

from __future__ import annotations

import itertools
import json
import re
from collections import Counter
from collections.abc import Sequence

import numpy as np
from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from demo.curriculum import TOOL_EXCHANGES
from demo.dialogue import ADDED_TOKENS, DEMO_CHAT_TEMPLATE, Mode, conversation
from demo.tasks import make_scene
from demo.world import COLORS, DIRECTIONS, SHAPES, TASKS, Sample
from llm_core.model.chat import MULTIMODAL_SPECIAL_TOKENS, ChatTemplate
from llm_core.loading.checkpoint import SPECIAL_TOKENS


_EARLIER_TASKS = tuple(t for t in TASKS if t != "video_info")  # the language the BPE was first trained on
DIALOGUE_MERGES = 100  # BPE merges for the words of tools and reasoning (each a row in embed and head)


def _corpus(seed: int) -> list[str]:
    """The questions and answers of the tasks without the tool, and the role names."""
    rng = np.random.default_rng(seed)
    # Only the words matter: scenes are drawn (as samples would be) but never rendered.
    tasks = _EARLIER_TASKS
    texts = [f"{q} {a}" for _, q, a in (make_scene(rng, tasks[i % len(tasks)]) for i in range(1800))]
    texts += [" ".join((*COLORS, *SHAPES, *DIRECTIONS, "high", "low", "1", "2", "3", "4", "5"))]
    texts += ["user\n", "assistant\n", "system\n"] * 50
    return texts


def _dialogue_texts(seed: int) -> list[str]:
    """Prompts and answers of every task in every way of asking, media left out: the
    words the tool block, calls, results, replies and reasonings are made of."""
    rng = np.random.default_rng(seed + 11)
    template = ChatTemplate(DEMO_CHAT_TEMPLATE)
    texts: list[str] = []
    for i in range(200):
        task = TASKS[i % len(TASKS)]
        scene, question, answer = make_scene(rng, task)
        sample = Sample(task, question, answer, scene.media, None, None, None, scene)
        modes = [*TOOL_EXCHANGES] if task == "video_info" else [Mode(tools=True)]
        for mode in modes:
            for thinking in (False, True):
                conv = conversation(sample, Mode(mode.tools, thinking, mode.tool_result))
                user = {"role": "user", "content": question}
                # What the model writes weighs more than the prompt: the fewer tokens an
                # answer has, the fewer it must get exactly right.
                texts += [template.render([user, *conv.follow_up], **conv.variables), *[conv.output] * 8]
    return texts


def build_tokenizer(seed: int) -> HFTokenizer:
    """Byte-level BPE over the demo language (its words become single tokens), grown
    for tools and thinking as a checkpoint from before them is when fine-tuned."""
    return with_dialogue_vocabulary(base_tokenizer(seed), seed)


def base_tokenizer(seed: int) -> HFTokenizer:
    """Byte-level BPE over the earlier tasks' language: its words become single tokens."""
    tokenizer = HFTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=448,
        special_tokens=[*SPECIAL_TOKENS, *MULTIMODAL_SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(seed), trainer)
    return tokenizer


def with_dialogue_vocabulary(tokenizer: HFTokenizer, seed: int = 0) -> HFTokenizer:
    """The tokenizer grown for tools and thinking, unless it already is: BPE merges
    for their words, then the markers as single tokens. The new ids come after the
    old ones and no merge applies to the earlier tasks' words, so their texts keep
    their token ids (and a checkpoint trained on them its embedding rows)."""
    if all(tokenizer.token_to_id(t) is not None for t in ADDED_TOKENS):
        return tokenizer
    grown = extend_merges(tokenizer, _dialogue_texts(seed), keep=_corpus(seed), max_new=DIALOGUE_MERGES)
    vocab = grown.get_vocab(with_added_tokens=True)
    grown.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS if t not in vocab])
    return grown


def _word_counts(tokenizer: HFTokenizer, texts: Sequence[str]) -> Counter[str]:
    """Pre-tokenized words (byte-level form) of ``texts``, special and marker tokens cut out."""
    markers = [*SPECIAL_TOKENS, *MULTIMODAL_SPECIAL_TOKENS, *ADDED_TOKENS]
    split = re.compile("|".join(re.escape(m) for m in markers))
    counts: Counter[str] = Counter()
    for text in texts:
        for chunk in split.split(text):
            counts.update(word for word, _ in tokenizer.pre_tokenizer.pre_tokenize_str(chunk))
    return counts


def extend_merges(tokenizer: HFTokenizer, texts: Sequence[str], keep: Sequence[str], max_new: int) -> HFTokenizer:
    """A copy of ``tokenizer`` with up to ``max_new`` BPE merges appended, learnt as
    BPE learns them (the most frequent adjacent pair of ``texts``' tokens first).

    Appended merges apply only after every earlier one, to the tokens those leave;
    a pair found next to each other in a word of ``keep`` is never merged, so the
    texts of ``keep`` keep their tokens. Nor is a pair with a digit: numbers stay a
    token per digit, which the model copies from a tool result to its answer."""
    data = json.loads(tokenizer.to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    merges: list[list[str]] = data["model"]["merges"]
    counts = _word_counts(tokenizer, texts)
    words = {w: [t.value for t in tokenizer.model.tokenize(w)] for w in counts}
    kept = {w: [t.value for t in tokenizer.model.tokenize(w)] for w in _word_counts(tokenizer, keep)}
    forbidden = {pair for tokens in kept.values() for pair in itertools.pairwise(tokens)}
    next_id = max(*vocab.values(), *(t["id"] for t in data["added_tokens"])) + 1
    for _ in range(max_new):
        pairs: Counter[tuple[str, str]] = Counter()
        for word, tokens in words.items():
            for pair in itertools.pairwise(tokens):
                if pair not in forbidden and not any(c.isdigit() for c in "".join(pair)):
                    pairs[pair] += counts[word]
        if not pairs:
            break
        # The most frequent pair; ties in a fixed order, so the vocabulary is a function of the texts.
        (a, b), _ = max(pairs.items(), key=lambda item: (item[1], item[0]))
        merges.append([a, b])
        if a + b not in vocab:
            vocab[a + b] = next_id
            next_id += 1
        words = {w: _merge(tokens, a, b) for w, tokens in words.items()}
    return HFTokenizer.from_str(json.dumps(data))


def _merge(tokens: list[str], a: str, b: str) -> list[str]:
    out: list[str] = []
    for token in tokens:
        if out and out[-1] == a and token == b:
            out[-1] = a + b
        else:
            out.append(token)
    return out
