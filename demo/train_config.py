"""The settings of a ``swallow train-demo`` run: ``TrainConfig`` (training from
scratch), and ``finetune_config`` (fine-tuning a trained checkpoint with ``--init``)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TrainConfig", "finetune_config"]


@dataclass(frozen=True)
class TrainConfig:
    seed: int = 0
    batch_size: int = 32
    max_steps: int = 3600
    max_minutes: float = 38.0
    lr: float = 1e-3
    warmup_steps: int = 60
    weight_decay: float = 0.01
    mtp_loss_weight: float = 0.3
    mtp_examples: int = 12  # examples per batch the MTP chain is trained on (longest answers first)
    # A part of an answer this long or shorter weighs one per token; a longer part
    # weighs this much in all (see ``demo.train._token_weights``).
    answer_tokens_weighed: int = 5
    # Stop early once every task's answers (teacher-forced, fresh samples) are this accurate.
    target_accuracy: float = 0.995
    accuracy_window: int = 400  # samples per task the running accuracy covers
    log_every: int = 10
    # Once every task is drawn (the last phase; all along when fine-tuning): the share
    # of the other tasks' examples asked in thinking mode, and with the tool listed.
    thinking_share: float = 0.3
    tools_share: float = 0.15
    # On top of the full mix, this share of examples are tool round trips (half of
    # them in thinking mode): reading a number back from the tool's result is the
    # skill the mix gives the fewest examples of (a second fine-tune sets it).
    round_trip_share: float = 0.0
    # Fine-tuning keeps what the encoders learnt: the new skills are the LLM's only
    # (the tool questions are about the file, reasoning is text), and frozen towers
    # skip their backward pass, over half a step's time.
    freeze_encoders: bool = False


def finetune_config(**overrides: object) -> TrainConfig:
    """The settings of ``train-demo --init``: from a trained checkpoint, a gentler
    learning rate, frozen encoders, and a budget of minutes rather than hours."""
    # Half batches, twice the steps: the new skills are mostly fixed texts, learnt per
    # step. Their telling tokens (the property asked for, the digits of a result) sit
    # in 10-30-token answers, so each answer token weighs one, as a one-word answer
    # does: by now the templated tokens cost next to nothing. Drafts matter less than
    # answers: the MTP chain runs on fewer examples.
    base = {"batch_size": 16, "max_steps": 1500, "max_minutes": 18.0, "lr": 5e-4, "warmup_steps": 50,
            "freeze_encoders": True, "target_accuracy": 1.0, "answer_tokens_weighed": 32, "mtp_examples": 6}
    return TrainConfig(**{**base, **overrides})  # type: ignore[arg-type]
