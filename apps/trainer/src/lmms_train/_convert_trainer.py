"""lmms-engine's `trainer_args` (mostly HF `TrainingArguments`) as lmms-train keys.

Keys with a meaning of their own are handled by topic: the step and batch sizes, sharding, data
loading, the optimisation, and run control (logging sinks, checkpoints, evaluation, profiling).
The rest go by the tables of `_convert_tables`: the same key (`_SAME`), a key lmms-train also
has (`_SAME_AS_OURS`), an HF key that may only hold its default (`_HF_DEFAULT_ONLY`), HF
bookkeeping (`_HF_IGNORED`), else an lmms-train key or an unknown one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lmms_train._convert_tables import (
    _FREEZE,
    _HF_DEFAULT_ONLY,
    _HF_IGNORED,
    _SAME,
    _SAME_AS_OURS,
    _SCHEDULES,
)

if TYPE_CHECKING:
    from lmms_train._convert_config import _Converter

__all__ = ["convert_trainer_args"]

_TOPICS = {
    "steps": ("per_device_train_batch_size", "gradient_accumulation_steps", "max_steps",
              "num_train_epochs"),
    "sharding": ("deepspeed", "fsdp2", "fsdp_config", "fsdp", "reduce_dtype", "output_dtype"),
    "loading": ("dataloader_num_workers", "dataloader_prefetch_factor"),
    "optimisation": ("gradient_checkpointing", "lr_scheduler_type", "lr_scheduler_kwargs",
                     "use_muon", "optim", "torch_compile", "freeze_modules"),
    "run_control": ("report_to", "resume_from_checkpoint", "enable_profiler", "profiler_config",
                    "eval_steps", "save_steps"),
}  # fmt: skip
_TOPIC_OF = {key: topic for topic, keys in _TOPICS.items() for key in keys}


def convert_trainer_args(cv: _Converter, t: dict[str, Any]) -> None:
    """Every key of `t` mapped into `cv`'s config, dropped with a note, or a problem."""
    _TrainerArgs(cv, t).convert()


class _TrainerArgs:
    def __init__(self, cv: _Converter, t: dict[str, Any]) -> None:
        from lmms_train.config._schema import TrainerArgs

        self.cv, self.t = cv, t
        self.known = tuple(TrainerArgs.__dataclass_fields__)
        max_steps = t.get("max_steps")
        self.has_steps = isinstance(max_steps, int) and max_steps > 0

    def convert(self) -> None:
        cv = self.cv
        for key, value in self.t.items():
            src = f"trainer_args.{key}"
            if key in _TOPIC_OF:
                getattr(self, _TOPIC_OF[key])(src, key, value)
            elif key in _SAME:
                if value is not None:
                    cv.set(src, value)
            elif key in _SAME_AS_OURS:
                cv.same_as_ours(src, key, value)
            elif key in _HF_DEFAULT_ONLY:
                cv.default_only(src, key, value)
            elif key in _HF_IGNORED:
                cv.c.dropped_hf.append(key)
            elif key in self.known:
                cv.set(src, value)
            else:
                cv.unknown(src, value, "trainer_args", self.known)

    def steps(self, src: str, key: str, value: Any) -> None:
        """Micro-batches per step (HF's batch size x accumulation), max_steps, epochs."""
        cv, t = self.cv, self.t
        if key in ("per_device_train_batch_size", "gradient_accumulation_steps"):
            batch = t.get("per_device_train_batch_size") or 1
            accum = t.get("gradient_accumulation_steps") or 1
            cv.set("trainer_args.gradient_accumulation_steps", int(batch) * int(accum),
                   src, "micro-batches per step = per_device_train_batch_size x "
                   "gradient_accumulation_steps; each micro-batch is one packed row")  # fmt: skip
        elif key == "max_steps":
            if self.has_steps:
                cv.set("trainer_args.max_steps", value)
            elif "num_train_epochs" not in t:
                cv.problem(src, value, "lmms-train runs for trainer_args.max_steps, or "
                           "max_steps: -1 with dataset_config.num_epochs")  # fmt: skip
        elif self.has_steps:  # num_train_epochs
            cv.drop(src, "max_steps is set and wins (as in HF); the data repeats")
        else:
            cv.set("dataset_config.num_epochs", max(1, round(value or 1)), src,
                   "with trainer_args.max_steps: -1 the run ends after this many "
                   "passes over the data")  # fmt: skip
            cv.set("trainer_args.max_steps", -1)

    def sharding(self, src: str, key: str, value: Any) -> None:
        """DeepSpeed and FSDP settings: FSDP2 is how lmms-train shards."""
        cv = self.cv
        if key == "deepspeed":
            if value:
                cv.drop(src, "lmms-train shards with FSDP2 (ZeRO-3-like; "
                        "trainer_args.fsdp, dp_replicate, fsdp_cpu_offload): the DeepSpeed "
                        "JSON is not read")  # fmt: skip
        elif key == "fsdp2":
            cv.drop(src, "FSDP2 is how lmms-train shards on several processes "
                         "(trainer_args.fsdp: null); one process uses fp32 master weights")  # fmt: skip
        elif key == "fsdp_config":
            for k, v in (value or {}).items():
                if k == "reshard_after_forward":
                    cv.set("trainer_args.reshard_after_forward", bool(v), f"{src}.{k}")
                elif k == "cpu_offload" or k == "offload_params":
                    cv.set("trainer_args.fsdp_cpu_offload", bool(v), f"{src}.{k}")
                else:
                    cv.drop(f"{src}.{k}", "lmms_models wraps every decoder and vision block")
        elif key == "fsdp":
            if isinstance(value, bool) or value is None:  # lmms-train's own key
                cv.set("trainer_args.fsdp", value)
            elif value not in ([], ""):
                cv.drop(src, "FSDP2 full sharding on several processes")
        else:  # reduce_dtype, output_dtype
            cv.drop(src, "lmms-train reduces gradients in fp32 and computes in bf16; the "
                         "export dtype is trainer_args.export_dtype")  # fmt: skip

    def loading(self, src: str, key: str, value: Any) -> None:
        """The data loader's workers and prefetch."""
        if key == "dataloader_num_workers":
            self.cv.set("dataset_config.num_workers", value, src)
        elif value is not None:  # dataloader_prefetch_factor
            self.cv.set("dataset_config.prefetch_factor", value, src)

    def optimisation(self, src: str, key: str, value: Any) -> None:
        """The optimizer, its schedule, activation checkpointing, compile and frozen modules."""
        cv, t = self.cv, self.t
        if key == "gradient_checkpointing":
            mode = "full" if value else "none"
            cv.set("trainer_args.activation_checkpointing", mode, src)
        elif key == "lr_scheduler_type":
            self.schedule(src, value, t.get("lr_scheduler_kwargs") or {})
        elif key == "use_muon":
            if value:
                cv.set("trainer_args.optimizer", "muon", src)
        elif key == "optim":
            if str(value).startswith("adamw") or value is None:
                if not t.get("use_muon"):
                    cv.set("trainer_args.optimizer", "adamw", src, "fused AdamW")
            elif value == "muon":
                cv.set("trainer_args.optimizer", "muon", src)
            else:
                cv.problem(src, value, "trainer_args.optimizer is adamw or muon")
        elif key == "freeze_modules":
            if value:
                cv.set("trainer_args.freeze", [_FREEZE.get(v, v) for v in value], src)
        elif key == "torch_compile":
            cv.set("trainer_args.compile", bool(value), src)
        # lr_scheduler_kwargs: read with lr_scheduler_type

    def run_control(self, src: str, key: str, value: Any) -> None:
        """Metric sinks, resuming, profiling, evaluation and checkpoint intervals."""
        cv, t = self.cv, self.t
        if key == "resume_from_checkpoint":
            if value:
                cv.set("trainer_args.resume_from", "latest" if value is True else value, src)
        elif key == "enable_profiler":
            if value:
                pc = t.get("profiler_config") or {}
                steps = [int(pc.get("start_step", 1)), int(pc.get("end_step", 3))]
                cv.set("trainer_args.profile_steps", steps, src)
        elif key == "eval_steps":
            if value and t.get("eval_strategy", "steps") != "no":
                cv.set("trainer_args.eval_steps", value)
        elif key == "save_steps":
            if t.get("save_strategy", "steps") == "steps" and value is not None:
                cv.set("trainer_args.save_steps", int(value))
        elif key == "report_to":
            self.report(src, value)
        # profiler_config: read with enable_profiler

    def schedule(self, src: str, value: Any, kwargs: dict[str, Any]) -> None:
        cv = self.cv
        if value not in _SCHEDULES:
            cv.problem(
                src,
                value,
                f"trainer_args.lr_scheduler_type, one of {sorted(set(_SCHEDULES.values()))}",
            )
            return
        cv.set("trainer_args.lr_scheduler_type", _SCHEDULES[value], src)
        for k, v in kwargs.items():
            if k == "min_lr_rate":
                cv.set("trainer_args.min_lr_ratio", v, f"trainer_args.lr_scheduler_kwargs.{k}")
            elif k in ("decay_ratio", "num_decay_ratio"):
                cv.set("trainer_args.wsd_decay_ratio", v, f"trainer_args.lr_scheduler_kwargs.{k}")
            else:
                cv.problem(f"trainer_args.lr_scheduler_kwargs.{k}", v,
                           "trainer_args.min_lr_ratio / wsd_decay_ratio / warmup_steps")  # fmt: skip

    def report(self, src: str, value: Any) -> None:
        sinks = [value] if isinstance(value, str) else list(value or [])
        if sinks in (["none"], ["None"]):
            sinks = []
        if sinks == ["all"]:
            sinks = ["wandb", "tensorboard"]
        bad = [s for s in sinks if s not in ("wandb", "tensorboard", "console", "jsonl")]
        if bad:
            self.cv.problem(src, bad, "trainer_args.report_to takes console, wandb, tensorboard "
                            "(metrics.jsonl is always written)")  # fmt: skip
        keep = ["console", *(s for s in sinks if s in ("wandb", "tensorboard"))]
        self.cv.set("trainer_args.report_to", keep, src)
