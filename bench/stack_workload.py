"""The seeded workload of `swallow bench stack` (``build_workload``): U users,
each holding a conversation of T turns behind a shared system prompt. Every
turn resends the whole history -- the first user message with its media file
(uploaded again, as a client would), the assistant's answers as returned, the
earlier questions -- plus a new question. About half the conversations start
with a video, some with an image or an audio clip, the rest are text only; a
few users send the same clip as an earlier user, so its embedding is reused
across users (and, depending on routing, across workers). Users start
staggered and think between turns; sampling is greedy.

Also what the workload's prompts come to on a model's tokenizer (a bound on
the longest, the prefix they all share) and its clips written as files.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "FOLLOW_UPS",
    "MEDIA_ROWS_BOUND",
    "MEDIA_TASKS",
    "SYSTEM_PROMPT",
    "Conversation",
    "MediaClip",
    "Workload",
    "WorkloadConfig",
    "build_workload",
    "estimate_prompt_tokens",
    "messages_for_turn",
    "shared_prefix_tokens",
    "write_clips",
]


SYSTEM_PROMPT = (
    "You are the assistant of a video library. Users show you short clips, pictures and sound recordings and "
    "ask about them. A clip shows one coloured shape on a black background: a circle, a square or a triangle, "
    "in red, green, blue or yellow. The shape may move left, right, up or down, blink, or change colour. "
    "Answer each question with a few words only: a direction, a colour, a shape, a number, or a short "
    "description."
)

# The demo world's tasks by the media a conversation starts with (``demo/world.py``).
MEDIA_TASKS: dict[str, tuple[str, ...]] = {
    "video": ("video_direction", "video_blink", "video_color", "describe", "video_audio_beeps"),
    "image": ("image_shape", "image_color"),
    "audio": ("audio_beeps", "audio_pitch"),
}
FOLLOW_UPS: dict[str, tuple[str, ...]] = {
    "video": ("Describe the video.", "How many times does the light blink?", "What colour does the square turn?",
              "Which way does the red circle move?", "How many beeps are in the video?",
              "What colour does the circle turn?", "Which way does the blue triangle move?"),
    "image": ("What shape is in the picture?", "What colour is the square?", "What colour is the circle?",
              "What colour is the triangle?"),
    "audio": ("How many beeps do you hear?", "Are the beeps high or low?"),
    "text": ("Describe the video.", "Which way does the red circle move?", "How many times does the light blink?",
             "What colour does the square turn?", "How many beeps do you hear?", "What shape is in the picture?"),
}
# Embedding rows one media item can take with the demo model's preprocessing
# (preprocessor_config.json: 8 frames of at most 84x84 px -> at most 36 rows; a
# picture at most 9; a 4 s clip about 101): an upper bound for the context check.
MEDIA_ROWS_BOUND: dict[str, int] = {"video": 40, "image": 12, "audio": 110}


@dataclass(frozen=True)
class WorkloadConfig:
    users: int = 16
    turns: int = 5
    video_share: float = 0.5  # of the conversations; a video may have a sound track (two media items)
    image_share: float = 0.15
    audio_share: float = 0.15  # the rest are text only
    shared_clip_share: float = 0.25  # of the media conversations: send an earlier user's clip
    share_lag_s: float = 1.5  # a user sharing a clip starts at least this long after its first sender
    max_tokens: int = 24
    think_s: tuple[float, float] = (0.3, 1.5)  # between a turn's answer and the next question
    stagger_s: float = 4.0  # users start spread over this many seconds
    system_prompt: str = SYSTEM_PROMPT

    def __post_init__(self) -> None:
        if self.users < 1 or self.turns < 1:
            raise ValueError(f"need at least one user and one turn, got {self.users} users, {self.turns} turns")
        if self.video_share + self.image_share + self.audio_share > 1.0 + 1e-9:
            raise ValueError("the media shares add up to more than 1")


@dataclass(frozen=True)
class MediaClip:
    """One media file of the demo world: ``make_sample(default_rng([seed, index]), task)`` renders it."""

    name: str
    task: str
    seed: int
    index: int
    kinds: tuple[str, ...]  # the media items it becomes in a prompt, in order ("video", "audio" for a sound track)
    question: str

    @property
    def kind(self) -> str:
        return self.kinds[0]


@dataclass(frozen=True)
class Conversation:
    user: int
    clip: MediaClip | None
    questions: tuple[str, ...]  # one per turn
    start_s: float
    think_s: tuple[float, ...]  # after each turn but the last
    shares_clip_of: int | None = None  # the user who first sent this clip

    @property
    def kind(self) -> str:
        return self.clip.kind if self.clip is not None else "text"


@dataclass(frozen=True)
class Workload:
    config: WorkloadConfig
    seed: int
    conversations: tuple[Conversation, ...]

    @property
    def clips(self) -> list[MediaClip]:
        """The distinct clips, in order of first use."""
        return list(dict.fromkeys(c.clip for c in self.conversations if c.clip is not None))

    @property
    def num_requests(self) -> int:
        return sum(len(c.questions) for c in self.conversations)

    def describe(self) -> dict[str, Any]:
        kinds: dict[str, int] = {}
        for conv in self.conversations:
            kinds[conv.kind] = kinds.get(conv.kind, 0) + 1
        return {
            "seed": self.seed,
            "users": len(self.conversations),
            "turns_per_user": self.config.turns,
            "requests": self.num_requests,
            "conversations_by_first_media": kinds,
            "distinct_clips": len(self.clips),
            "users_sharing_a_clip": sum(c.shares_clip_of is not None for c in self.conversations),
            "max_tokens": self.config.max_tokens,
            "temperature": 0,
            "think_s": list(self.config.think_s),
            "stagger_s": self.config.stagger_s,
            "system_prompt_chars": len(self.config.system_prompt),
            "each_turn": "the whole history (system prompt, first user message with its media file uploaded "
                         "again, the answers as returned, earlier questions) plus a new question",
        }


def _clip(seed: int, index: int, task: str) -> MediaClip:
    from demo.tasks import make_scene

    scene, question, _ = make_scene(np.random.default_rng([seed, index]), task)
    return MediaClip(f"clip-{index}", task, seed, index, scene.media, question)


def build_workload(seed: int = 0, config: WorkloadConfig = WorkloadConfig()) -> Workload:
    """The conversations of ``config``: a pure function of ``seed`` and ``config``."""
    rng = np.random.default_rng([seed, 1])
    n = config.users
    counts = {kind: round(n * share) for kind, share in
              (("video", config.video_share), ("image", config.image_share), ("audio", config.audio_share))}
    while sum(counts.values()) > n:  # rounding up everywhere can overshoot
        counts[max(counts, key=counts.__getitem__)] -= 1
    kinds = [kind for kind, count in counts.items() for _ in range(count)]
    kinds += ["text"] * (n - len(kinds))
    kinds = [kinds[i] for i in rng.permutation(n)]
    starts = sorted(float(x) for x in rng.uniform(0.0, config.stagger_s, n))
    # Who sends an earlier user's clip: a seeded pick among the media users that have an earlier one.
    media_users = [u for u in range(n) if kinds[u] != "text"]
    num_sharing = round(len(media_users) * config.shared_clip_share)
    candidates = [u for u in media_users if any(kinds[v] == kinds[u] for v in media_users if v < u)]
    sharing = set(rng.choice(candidates, size=min(num_sharing, len(candidates)), replace=False).tolist()) \
        if candidates else set()
    conversations: list[Conversation] = []
    clip_index = 0
    for user in range(n):
        kind = kinds[user]
        clip, shares, start = None, None, starts[user]
        if kind != "text":
            if user in sharing:
                owners = [c for c in conversations if c.kind == kind and c.shares_clip_of is None]
                owner = owners[int(rng.integers(len(owners)))]
                clip, shares = owner.clip, owner.user
                start = max(start, owner.start_s + config.share_lag_s)
            else:
                tasks = MEDIA_TASKS[kind]
                clip = _clip(seed, clip_index, tasks[int(rng.integers(len(tasks)))])
                clip_index += 1
        pool = FOLLOW_UPS[kind]
        first = clip.question if clip is not None and shares is None else pool[int(rng.integers(len(pool)))]
        questions = (first, *(pool[int(rng.integers(len(pool)))] for _ in range(config.turns - 1)))
        think = tuple(round(float(x), 3) for x in rng.uniform(*config.think_s, config.turns - 1))
        conversations.append(Conversation(user, clip, questions, round(start, 3), think, shares))
    return Workload(config, seed, tuple(conversations))


def messages_for_turn(conv: Conversation, turn: int, answers: Sequence[str], system_prompt: str,
                      media_parts: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages of turn ``turn``: system prompt, history (with the media parts
    in the first user message, and the answers given), the turn's question."""
    if len(answers) < turn:
        raise ValueError(f"turn {turn} needs the {turn} answers before it, got {len(answers)}")
    messages: list[dict[str, Any]] = [{"role": "system", "content": system_prompt}]
    for k in range(turn + 1):
        text = {"type": "text", "text": conv.questions[k]}
        messages.append({"role": "user", "content": [*media_parts, text] if k == 0 and media_parts else [text]})
        if k < turn:
            messages.append({"role": "assistant", "content": answers[k]})
    return messages


def estimate_prompt_tokens(workload: Workload, model_dir: str | Path) -> list[int]:
    """An upper bound of each conversation's last prompt (its longest), with every
    answer as long as it can be (``max_tokens`` tokens, each taken as two when
    re-tokenised, to be safe) and every media item at its row bound."""
    from llm_core.model.chat import ChatTemplate
    from llm_core.model.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_model_dir(model_dir)
    if tokenizer is None:
        raise ValueError(f"{model_dir} has no tokenizer")
    template = ChatTemplate.from_model_dir(model_dir)
    config = workload.config
    out = []
    for conv in workload.conversations:
        last = len(conv.questions) - 1
        parts = [{"type": kind} for kind in conv.clip.kinds] if conv.clip is not None else []
        # The template renders one placeholder token per media item; the prompt has its rows.
        text = template.render(messages_for_turn(conv, last, [""] * last, config.system_prompt, parts))
        rows = sum(MEDIA_ROWS_BOUND[kind] - 1 for kind in (conv.clip.kinds if conv.clip is not None else ()))
        out.append(len(tokenizer.encode(text)) + rows + last * 2 * config.max_tokens)
    return out


def shared_prefix_tokens(workload: Workload, model_dir: str | Path) -> int:
    """Tokens every conversation's first prompt starts with (system prompt and the
    start of the first user message)."""
    from llm_core.model.chat import ChatTemplate
    from llm_core.model.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_model_dir(model_dir)
    if tokenizer is None:
        raise ValueError(f"{model_dir} has no tokenizer")
    template = ChatTemplate.from_model_dir(model_dir)
    prompts = []
    for conv in workload.conversations:
        parts = [{"type": kind} for kind in conv.clip.kinds] if conv.clip is not None else []
        prompts.append(tokenizer.encode(template.render(messages_for_turn(conv, 0, [], workload.config.system_prompt,
                                                                          parts))))
    common = min(len(p) for p in prompts)
    for i in range(common):
        if len({p[i] for p in prompts}) > 1:
            return i
    return common


def write_clips(workload: Workload, directory: Path) -> dict[str, Path]:
    """Each clip of the workload as a file (mp4 / png / wav)."""
    from demo.render import write_media
    from demo.tasks import make_sample

    files = {}
    for clip in workload.clips:
        sample = make_sample(np.random.default_rng([clip.seed, clip.index]), clip.task)
        (path,) = write_media(sample, directory, clip.name)
        files[clip.name] = path
    return files
