"""What each training step learns from, and how fast: the clock of training
progress, the learning-rate schedule over it, the curriculum of tasks along it, the
task mix and the ways of asking (thinking, the tool listed, the tool's round trip),
and the stream of batches they draw."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence

import numpy as np

from demo.dialogue import Mode
from demo.examples import PLAIN, Example, ExampleBuilder, meter_label
from demo.tasks import make_sample
from demo.train_config import TrainConfig
from demo.world import TASKS


class TrainingClock:
    """How far training is, in [0, 1]: the larger of the steps done and the wall-clock
    minutes used, each as a fraction of its budget. On an idle machine the step count
    leads and a run is a function of its seed alone; when the (shared) cores are slow,
    the clock leads, so the run still covers the whole curriculum and anneals its
    learning rate before ``max_minutes`` stops it."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg, self.started = cfg, time.monotonic()

    def minutes(self) -> float:
        return (time.monotonic() - self.started) / 60

    def progress(self, step: int, offset: int = 0) -> float:
        by_steps = (step - offset) / max(1, self.cfg.max_steps - offset)
        return min(1.0, max(by_steps, self.minutes() / self.cfg.max_minutes))


def learning_rate(step: int, cfg: TrainConfig, clock: TrainingClock) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = clock.progress(step, offset=cfg.warmup_steps)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


_IMAGE_TASKS = ("image_color", "image_shape", "audio_pitch")
_VISION_TASKS = (*_IMAGE_TASKS, "video_direction", "video_color", "video_blink", "describe")


def task_pool(progress: float) -> tuple[str, ...]:
    """A curriculum over training progress in [0, 1]: still images first (the vision
    path must learn to reach the LLM before it can carry motion), then videos, then
    everything. High-or-low beeps (short clips, few examples) come along from the
    start; the other sounds (longer, and only ever dilute the vision phases) wait
    for the last phase: drawn from the start, direction was not learnt in 1300 steps."""
    if progress < 0.08:
        return _IMAGE_TASKS
    if progress < 0.3:
        return _VISION_TASKS
    return TASKS


# How often each task is drawn in the last phase (all tasks), relative to the others.
# The hard skills get more examples: a square from a circle in a 56-84 px picture
# (four to nine merged tokens), the shape word inside the long describe answer (a
# moving shape, two frames per temporal patch: nearly every describe answer served
# wrong names the wrong shape, most of them moving sideways), and counting beeps and
# blinks. Colours are learnt within the first phases and need few examples after.
# Pictures are short sequences, so extra picture examples are cheap.
TASK_WEIGHTS: dict[str, float] = {
    "image_shape": 4.0,
    "describe": 5.0,
    "video_audio_beeps": 1.5,
    "audio_beeps": 1.75,
    "video_blink": 1.25,
    "image_color": 0.5,
    "video_color": 0.5,
    # Three exchanges (the call, the answer from the result, no tool listed), the
    # reply copying numbers from the result.
    "video_info": 5.0,
}
# How a video_info question is asked: the tool listed and not called yet, its result
# in, or no tool listed (the model must then never call one).
TOOL_EXCHANGES: dict[Mode, float] = {
    Mode(tools=True): 0.4,
    Mode(tools=True, tool_result=True): 0.45,
    Mode(): 0.15,
}
# Before the last phase: colours carry the first signal through the vision path,
# pitch needs few examples (drawn only from the last phase, one run never told high
# from low), and motion weighs more: with frames of every size and aspect ratio
# (grids of 2x2 to 4x2 merged tokens) direction is learnt suddenly after a few
# thousand examples, and only once that happens can "describe" be learnt; diluted
# in the full mix it had not happened after 1400 steps.
EARLY_WEIGHTS: dict[str, float] = {
    "image_color": 1.0, "video_color": 1.0, "audio_pitch": 0.3, "video_direction": 4.0, "describe": 3.5,
}


def _task_probabilities(pool: Sequence[str]) -> np.ndarray:
    early = EARLY_WEIGHTS if pool != TASKS else {}
    weights = np.array([early.get(task, TASK_WEIGHTS.get(task, 1.0)) for task in pool])
    return weights / weights.sum()


def draw_mode(task: str, rng: np.random.Generator, cfg: TrainConfig, thinking: bool) -> Mode:
    """How a sample of the full mix is asked: the other tasks with the tool listed
    now and then (and the same answer), the file questions in one of the exchanges."""
    if task == "video_info":
        modes = list(TOOL_EXCHANGES)
        weights = np.array(list(TOOL_EXCHANGES.values()))
        mode = modes[int(rng.choice(len(modes), p=weights / weights.sum()))]
        return Mode(mode.tools, thinking, mode.tool_result)
    return Mode(tools=bool(rng.random() < cfg.tools_share), thinking=thinking)


def mix_labels() -> tuple[str, ...]:
    """Every meter label the full mix produces."""
    plain = tuple(t for t in TASKS if t != "video_info")
    tool = tuple(dict.fromkeys(meter_label("video_info", m) for m in TOOL_EXCHANGES))
    return (*plain, "thinking", "tools_listed", *tool)


def batches(builder: ExampleBuilder, cfg: TrainConfig, clock: TrainingClock,
            curriculum: bool) -> Iterator[list[Example]]:
    """Batches of fresh samples: along the curriculum from scratch, the full mix
    (every task, every way of asking) when fine-tuning."""
    rng = np.random.default_rng(cfg.seed + 7)
    step = 0
    while True:
        pool = task_pool(clock.progress(step)) if curriculum else TASKS
        # Thinking and tools wait for the last phase: the early phases teach perception.
        draws = [_draw(rng, pool, cfg, full_mix=pool == TASKS) for _ in range(cfg.batch_size)]
        yield [builder.build(make_sample(rng, task), rng, mode) for task, mode in draws]
        step += 1


def _draw(rng: np.random.Generator, pool: Sequence[str], cfg: TrainConfig, full_mix: bool) -> tuple[str, Mode]:
    """One example's task and way of asking. A thinking example's task is drawn
    uniformly: each kind of question has its own reasoning to learn, however rarely
    its answers need practice."""
    if full_mix and cfg.round_trip_share and rng.random() < cfg.round_trip_share:
        return "video_info", Mode(tools=True, thinking=bool(rng.random() < 0.5), tool_result=True)
    if full_mix and rng.random() < cfg.thinking_share:
        task = pool[int(rng.integers(len(pool)))]
        return task, draw_mode(task, rng, cfg, thinking=True)
    task = pool[int(rng.choice(len(pool), p=_task_probabilities(pool)))]
    return task, draw_mode(task, rng, cfg, thinking=False) if full_mix else PLAIN

