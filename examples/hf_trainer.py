"""A Hugging Face Trainer + peft LoRA fine-tune that runs unchanged under torchrun and herd.

Nothing is downloaded: the "pretrained" model is a tiny GPT-2 built from a config, and the
tokenizer is a character-level one built in code from examples/data/tiny.txt. The point is
that an ordinary Hugging Face script needs no torchherd code to run on many machines:
the Trainer reads torchrun's environment itself.

    pip install 'torchherd[hf]'
    python examples/hf_trainer.py --max-steps 20
    torchrun --standalone --nproc-per-node 2 examples/hf_trainer.py --max-steps 20
    herd launch examples/hf_trainer.py --max-steps 200

Checkpoints (HF's checkpoint-N folders) go to --run-dir and a rerun resumes from the last one;
each logged step is appended to <run-dir>/metrics.jsonl by a small callback.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, get_peft_model
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from torch.utils.data import Dataset
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    PreTrainedTokenizerFast,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)
from transformers.trainer_utils import get_last_checkpoint

TEXT = Path(__file__).resolve().parent / "data" / "tiny.txt"


def char_tokenizer(text: str) -> PreTrainedTokenizerFast:
    """One token per character, plus <unk> and <pad>, as a regular HF fast tokenizer."""
    vocab = {"<unk>": 0, "<pad>": 1}
    for char in sorted(set(text)):
        vocab.setdefault(char, len(vocab))
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r".|\n"), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", pad_token="<pad>")


class Blocks(Dataset[dict[str, torch.Tensor]]):
    """Consecutive blocks of token ids; labels are the inputs (the model shifts them)."""

    def __init__(self, ids: list[int], block_size: int) -> None:
        usable = len(ids) - len(ids) % block_size
        self.blocks = torch.tensor(ids[:usable]).view(-1, block_size)

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.blocks[index], "labels": self.blocks[index]}


class JsonlMetrics(TrainerCallback):
    """Appends every log entry with a loss to <run-dir>/metrics.jsonl, on the main process."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        if state.is_world_process_zero and logs and "loss" in logs:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as out:
                out.write(json.dumps({"step": state.global_step, **logs}) + "\n")


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=40, help="optimizer steps in all")
    parser.add_argument("--snapshot-every", type=int, default=20, help="checkpoint every N steps")
    parser.add_argument("--run-dir", default="runs/hf", help="checkpoints and metrics.jsonl")
    parser.add_argument("--batch-size", type=int, default=8, help="per process")
    parser.add_argument("--block-size", type=int, default=64, help="characters per sample")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    text = TEXT.read_text(encoding="utf-8")
    tokenizer = char_tokenizer(text)
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=args.block_size,
        n_embd=64,
        n_layer=2,
        n_head=4,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)  # the same "pretrained" weights in every process
    base = GPT2LMHeadModel(config)
    # GPT-2 keeps its projections in Conv1D layers, whose weights are stored transposed.
    lora = LoraConfig(
        r=8, lora_alpha=16, target_modules=["c_attn"], fan_in_fan_out=True, task_type="CAUSAL_LM"
    )
    model = get_peft_model(base, lora)

    training = TrainingArguments(
        output_dir=args.run_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        learning_rate=5e-3,
        logging_steps=1,
        save_strategy="steps",
        save_steps=args.snapshot_every,
        save_total_limit=3,
        report_to="none",
        use_cpu=not torch.cuda.is_available(),
        seed=0,
        disable_tqdm=True,  # plain log lines: the launcher prefixes and merges them
        ddp_find_unused_parameters=False,  # LoRA leaves no parameter unused in forward
    )
    trainer = Trainer(
        model=model,
        args=training,
        train_dataset=Blocks(tokenizer(text)["input_ids"], args.block_size),
        callbacks=[JsonlMetrics(Path(args.run_dir) / "metrics.jsonl")],
    )
    last = get_last_checkpoint(args.run_dir) if Path(args.run_dir).is_dir() else None
    trainer.train(resume_from_checkpoint=last)
    if trainer.is_world_process_zero():
        start = f"resumed from {last}" if last else "from the start"
        print(f"done: {trainer.state.global_step} steps, {start}")
    if torch.distributed.is_initialized():
        # The Trainer leaves its process group to interpreter exit, where destroying it while
        # a Gloo thread still finishes the last collective can hang or abort the process.
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
        # The Trainer's DDP wrapper still holds the group, freed when main() returns. Its
        # destructor waits for Gloo's threads, which may still need the GIL to release the
        # barrier's tensors: the process hung there once in ~30 runs under load (upstream
        # pytorch/pytorch#190489). A moment with the GIL free lets them finish first.
        time.sleep(0.25)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
