"""The demo's commands: `swallow train-demo`, `eval-demo` and `demo video-qa`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from api.models import DEMO_MODEL_DIR, ensure_default_model


def add_demo_commands(commands: Any) -> None:
    """The demo's sub-commands on `swallow`'s command line."""
    train = commands.add_parser("train-demo", help="train the demo model on the synthetic world")
    train.add_argument("--out", default=str(DEMO_MODEL_DIR), help="checkpoint directory to write")
    # Unset options keep TrainConfig's defaults: the settings the committed model was trained with.
    train.add_argument("--seed", type=int)
    train.add_argument("--batch-size", type=int)
    train.add_argument("--max-steps", type=int)
    train.add_argument("--max-minutes", type=float)
    train.add_argument("--lr", type=float, help="peak learning rate (default: 1e-3 from scratch, 5e-4 fine-tuning)")
    train.add_argument("--round-trip-share", type=float,
                       help="share of examples that are tool round trips on top of the mix (fine-tuning; default 0)")
    train.add_argument("--init", help="fine-tune this trained demo checkpoint (e.g. models/demo) instead of "
                                      "training from scratch: every task, thinking and the video tool mixed")
    train.add_argument("--quiet", action="store_true", help="no progress bar")
    train.set_defaults(func=_train_demo)

    evaluate = commands.add_parser("eval-demo", help="score the demo model on a held-out synthetic world")
    evaluate.add_argument("--model", help="checkpoint (default: the committed demo model)")
    evaluate.add_argument("--seed", type=int, help="world seed (default: one training never uses)")
    evaluate.add_argument("--per-task", type=int, default=34, help="items per task (10 tasks)")
    evaluate.add_argument("--json", action="store_true", help="one-line JSON")
    evaluate.set_defaults(func=_eval_demo)

    demo = commands.add_parser("demo", help="ask the demo model about a file, through the server's code path")
    demo_sub = demo.add_subparsers(dest="demo_command", required=True)
    video_qa = demo_sub.add_parser("video-qa", help="answer a question about a video")
    video_qa.add_argument("--video", required=True)
    video_qa.add_argument("--question", required=True)
    video_qa.add_argument("--model", help="checkpoint (default: the demo model)")
    video_qa.set_defaults(func=_demo)


def _train_demo(args: argparse.Namespace) -> int:
    from demo.train import train_demo
    from demo.train_config import TrainConfig, finetune_config

    given = {"seed": args.seed, "batch_size": args.batch_size, "max_steps": args.max_steps,
             "max_minutes": args.max_minutes, "lr": args.lr, "round_trip_share": args.round_trip_share}
    chosen = {name: value for name, value in given.items() if value is not None}
    # Fine-tuning has its own defaults (learning rate, budget, frozen encoders).
    config = finetune_config(**chosen) if args.init else TrainConfig(**chosen)
    summary = train_demo(args.out, config, progress=not args.quiet, init=args.init)
    print(json.dumps(summary))
    return 0


def _eval_demo(args: argparse.Namespace) -> int:
    from demo.evaluate import EVAL_SEED, eval_demo

    model = Path(args.model) if args.model else DEMO_MODEL_DIR
    result = eval_demo(model, seed=args.seed if args.seed is not None else EVAL_SEED, per_task=args.per_task)
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from demo.evaluate import ask

    model = Path(args.model) if args.model else ensure_default_model()
    print(ask(model, args.question, [args.video]))
    return 0
