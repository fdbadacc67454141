"""transformers' Trainer, training through conveyor.Module:

    from conveyor.trainer import ConveyorTrainer
    trainer = ConveyorTrainer(model=net, args=TrainingArguments(...), train_dataset=..., eval_dataset=...,
                              conveyor=dict(devices=2))    # conveyor.Module's options; all optional
    trainer.train()                                       # or train(resume_from_checkpoint=True)

The Trainer's own optimizer and scheduler (made after the model is wrapped), gradient
accumulation, `max_grad_norm` clipping (the norm across processes), logging, evaluation and
`save_steps` checkpoints work as without conveyor, and the same script runs under `torchrun
--nproc-per-node N` with the Trainer's own data loading (each process its share:
batches="shares").

Why a Trainer subclass, not a callback or an accelerate plugin. DeepSpeed reaches Trainer as
an accelerate plugin (`DistributedType.DEEPSPEED`), but that is an enumeration inside
accelerate, with its own branches in `Accelerator.prepare`, `backward`, `clip_grad_norm_` and
the dataloaders, and a matching `is_deepspeed_enabled` branch in Trainer's step, clipping,
checkpoint save and load (`deepspeed_init`, `deepspeed_load_checkpoint`): there is no
plugin seam a third party can fill. A callback sees events but cannot change how the model
is wrapped, how the loss is read, how gradients are clipped or what a checkpoint holds. So
this subclass takes DeepSpeed's place in those same methods, and only there: `self.model`
stays the user's model (its config, its signature for the dataset's columns, its labels)
and `self.model_wrapped` is the conveyor.Module, as DeepSpeed's engine is; accelerate
prepares the optimizer and dataloaders but never wraps the model (no DDP: conveyor's
replicas are its data parallelism).

What differs, and why:
- The loss. As without conveyor, a model that takes loss kwargs is given `num_items_in_batch`,
  the label tokens of every batch accumulated into the step, and divides its summed loss by
  it: conveyor's step is then a sum over its shares, exact however it splits the batch. Under
  torchrun the count is every process's together (gathered even where
  `average_tokens_across_devices=False`: conveyor's step holds every process's share), and
  the loss is not multiplied by the processes as for DDP, which averages the processes'
  gradients: conveyor's loss is the whole step's already. A model without loss kwargs
  returns its own mean over the tokens it counts (counted_targets.py), which Trainer divides
  by the accumulation steps, as it does without conveyor.
- Checkpoints. `checkpoint-<step>/conveyor/` is conveyor.Module.save_checkpoint's folder (the
  model and optimizer, each process writing what it owns), beside Trainer's scheduler,
  random states and trainer_state.json; `resume_from_checkpoint` reads it on any plan and
  process count. `trainer.save_model(folder)` writes a from_pretrained folder
  (conveyor.Module.save_pretrained, each process its shard).
- Evaluation returns the loss alone (conveyor.Module(returns="model"), as_model.py): metrics
  over logits (`compute_metrics`) are not available; `eval_loss` is.
What conveyor cannot honour is refused in the constructor, naming what to change
(`_refusals`).
"""
from __future__ import annotations

import os

import torch

try:
    import transformers
except ImportError as e:  # an optional dependency: said on use
    raise ImportError("conveyor.trainer needs transformers (and accelerate): pip install transformers accelerate") \
        from e

from .errors import ConveyorValueError
from .module import Module

__all__ = ["ConveyorTrainer", "CHECKPOINT_FOLDER"]

CHECKPOINT_FOLDER = "conveyor"  # checkpoint-<step>/conveyor: conveyor.Module.save_checkpoint's folder
SCHEDULER_FILE = "scheduler.pt"
ARGS_FILE = "training_args.bin"


def _refusals(args, kwargs: dict) -> list[str]:
    """What the Trainer is asked for that conveyor cannot honour, each with what to change."""
    said = []
    if args.deepspeed:
        said.append("deepspeed= with conveyor: conveyor plans and runs the model's layout itself; drop deepspeed= and "
                    "give conveyor.Module's options as conveyor=dict(stages=..., replicas=..., recompute=...)")
    if args.fsdp:
        said.append("fsdp= with conveyor: conveyor splits the model into pipeline stages and holds each stage's "
                    "parameters in its own processes; drop fsdp=")
    if args.torch_compile:
        said.append("torch_compile=True with conveyor: conveyor captures the model with torch.export and runs its "
                    "own graph; drop torch_compile=True")
    if args.activation_checkpointing or getattr(args, "gradient_checkpointing", False):
        said.append("activation (gradient) checkpointing with conveyor: pass conveyor=dict(recompute=True) (or "
                    "'selective') instead; conveyor recomputes where its plan needs it")
    if args.load_best_model_at_end:
        said.append("load_best_model_at_end=True with conveyor: not supported yet; resume from the best "
                    "checkpoint with train(resume_from_checkpoint=<folder>) instead")
    if args.label_smoothing_factor:
        said.append("label_smoothing_factor with conveyor: the smoothed loss needs the logits, which a pipelined "
                    "step does not return; compute the smoothed loss in the model's forward")
    if kwargs.get("compute_loss_func") is not None:
        said.append("compute_loss_func with conveyor: it needs the logits, which a pipelined step does not "
                    "return; compute the loss in the model's forward, or give conveyor=dict(loss_fn=...)")
    if kwargs.get("compute_metrics") is not None:
        said.append("compute_metrics with conveyor: evaluation returns the loss alone (the logits of a pipelined "
                    "step are not gathered); eval_loss is logged")
    if kwargs.get("model_init") is not None:
        said.append("model_init with conveyor: pass model= (one model, wrapped once)")
    return said


class ConveyorTrainer(transformers.Trainer):
    """transformers.Trainer whose model trains and evaluates through conveyor.Module; see
    the module docstring. `conveyor`: conveyor.Module's options (help(conveyor.Module.__init__))."""

    def __init__(self, model=None, args=None, *positional, conveyor: dict | None = None, **kwargs):
        if args is not None:
            said = _refusals(args, kwargs)
            if said:
                raise ConveyorValueError("ConveyorTrainer: " + "; ".join(said))
        elif kwargs.get("compute_loss_func") is not None or kwargs.get("compute_metrics") is not None:
            raise ConveyorValueError("ConveyorTrainer: " + "; ".join(_refusals(
                transformers.TrainingArguments(output_dir="tmp_trainer"), kwargs)))
        super().__init__(model, args, *positional, **kwargs)
        if self.args.n_gpu > 1:
            raise ConveyorValueError(f"ConveyorTrainer: this process sees {self.args.n_gpu} GPUs, which Trainer would "
                                     "drive with nn.DataParallel; run one process per GPU (torchrun "
                                     "--nproc-per-node N) or make one visible (CUDA_VISIBLE_DEVICES)")
        options = dict(conveyor or {})
        if "returns" in options or "batches" in options:
            raise ConveyorValueError("ConveyorTrainer sets conveyor.Module's returns= and batches= itself (the "
                                     "model's output type; each process its DistributedSampler share)")
        options.setdefault("verbose", False)
        self.conveyor_options = dict(options, returns="model",
                                     batches="shares" if self.args.world_size > 1 else "same")
        self.conveyor_model: Module | None = None

    def conveyor_module(self) -> Module:
        """The conveyor.Module the Trainer runs, made on first use with the Trainer's optimizer."""
        if self.conveyor_model is None:
            if self.optimizer is None:
                self.create_optimizer()
            optimizer = getattr(self.optimizer, "optimizer", self.optimizer)  # under accelerate's wrapper
            self.conveyor_model = Module(self.model, optimizer, **self.conveyor_options)
        return self.conveyor_model

    # -- where DeepSpeed's engine stands ------------------------------------------------
    def _wrap_model(self, model, training: bool = True, dataloader=None):
        return self.conveyor_module()

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device):
        count = super()._get_num_items_in_batch(batch_samples, device)
        if count is not None and self.args.world_size > 1 and not self.args.average_tokens_across_devices:
            count = self.accelerator.gather(torch.as_tensor(count, device=device).reshape(1)).sum()
        return count

    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        result = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                      num_items_in_batch=num_items_in_batch)
        if (self.args.average_tokens_across_devices and self.model_accepts_loss_kwargs
                and num_items_in_batch is not None and self.accelerator.num_processes > 1):
            # Trainer multiplied by the processes, for DDP's mean of their gradients.
            scale = self.accelerator.num_processes // self.get_tp_size()
            result = (result[0] / scale, result[1]) if return_outputs else result / scale
        return result

    def _clip_grad_norm(self, model):
        self.accelerator.unscale_gradients()  # a GradScaler's, where fp16 made one
        return self.conveyor_module().clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        if grad_norm is None:  # max_grad_norm 0: the norm alone, nothing clipped
            grad_norm = self.conveyor_module().clip_grad_norm_(float("inf"))
        return grad_norm

    # -- checkpoints: conveyor's folder, each process writing and reading its part -------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """A checkpoint's model (internal calls): within its conveyor/ folder, with the
        optimizer; the user's call: a from_pretrained folder. Collective under torchrun."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        module = self.conveyor_module()
        if _internal_call:
            module.save_checkpoint(os.path.join(output_dir, CHECKPOINT_FOLDER))
        else:
            module.save_pretrained(output_dir)
            if self.args.should_save and self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
        if self.args.should_save:
            torch.save(self.args, os.path.join(output_dir, ARGS_FILE))
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        # The optimizer's state is in the conveyor/ folder save_model wrote.
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_FILE))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        # Checked here, read in _load_optimizer_and_scheduler: after the scheduler is made, so
        # that the optimizer's saved learning rates are the ones it steps from, as Trainer's.
        if not os.path.isdir(os.path.join(resume_from_checkpoint, CHECKPOINT_FOLDER)):
            raise ConveyorValueError(f"{resume_from_checkpoint} holds no {CHECKPOINT_FOLDER}/ folder: it is not a "
                                     "checkpoint ConveyorTrainer saved; resume from one it saved (checkpoint-<step>), "
                                     "or load a from_pretrained folder into the model before making the Trainer")

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        self.conveyor_module().load_checkpoint(os.path.join(checkpoint, CHECKPOINT_FOLDER))
        scheduler = os.path.join(checkpoint, SCHEDULER_FILE)
        if os.path.isfile(scheduler):
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))
