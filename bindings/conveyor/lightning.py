"""Lightning's Trainer, training through conveyor.Module:

    class Lit(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = transformers.BertForMaskedLM(config)    # the model training_step calls
        def training_step(self, batch, index):
            loss = self.model(**batch).loss                       # pipelined under ConveyorStrategy
            self.log("train_loss", loss)
            return loss
        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    trainer = lightning.Trainer(strategy=ConveyorStrategy(devices=2), accelerator="cpu", gradient_clip_val=1.0)

The strategy wraps the LightningModule's model (`attribute=`, or its only child module) in a
conveyor.Module with the optimizer configure_optimizers returns, `returns="model"`: a call
returns the model's own output type holding the pipelined loss (as_model.py), and
`loss.backward()`, which Lightning runs, adds the step's gradients. training_step calls the
conveyor.Module wherever it calls `self.<attribute>`, and validation_step too (the forwards
alone); the LightningModule's module tree still holds the model itself, so its state_dict,
Lightning's checkpoints and their keys are the same as without conveyor. Gradient
accumulation, `gradient_clip_val` (by norm), logging, checkpointing and resuming are
Lightning's own.

One process: Lightning's checkpoints are written by process 0 from its own state_dict and
optimizer state, which across processes would hold only that process's stages, so a job
across processes is refused until the strategy writes conveyor's sharded checkpoint.
"""
from __future__ import annotations

import torch

try:
    from lightning.pytorch.strategies import SingleDeviceStrategy
    from lightning.pytorch.trainer.states import TrainerFn
except ImportError as e:  # an optional dependency: said on use
    raise ImportError("conveyor.lightning needs Lightning: pip install lightning") from e

from .errors import ConveyorValueError
from .module import Module

__all__ = ["ConveyorStrategy"]


class ConveyorStrategy(SingleDeviceStrategy):
    """A Lightning strategy whose LightningModule's model runs through conveyor.Module; see
    the module docstring. `attribute`: the LightningModule's attribute holding the model
    (default: its only child module); the other keywords are conveyor.Module's options."""

    strategy_name = "conveyor"

    def __init__(self, attribute: str | None = None, *, device: str | torch.device = "cpu", **conveyor_options):
        super().__init__(device=device)
        if "returns" in conveyor_options:
            raise ConveyorValueError("ConveyorStrategy sets conveyor.Module's returns= itself ('model': the model's "
                                     "own output type, as training_step reads it)")
        conveyor_options.setdefault("verbose", False)
        self.attribute = attribute
        self.conveyor_options = dict(conveyor_options, returns="model")
        self.conveyor_model: Module | None = None

    def setup(self, trainer) -> None:
        super().setup(trainer)
        lightning_module = self.lightning_module
        name = self._model_attribute(lightning_module)
        optimizer = None
        if trainer.state.fn == TrainerFn.FITTING:
            if len(self.optimizers) != 1:
                raise ConveyorValueError(f"ConveyorStrategy trains with one optimizer; configure_optimizers returned "
                                         f"{len(self.optimizers)}: return one over all the model's parameters")
            optimizer = self.optimizers[0]
        model = lightning_module._modules[name]
        made = self.conveyor_model
        if made is None or made.module is not model or made.optimizer is not optimizer:
            made = self.conveyor_model = Module(model, optimizer, **self.conveyor_options)
        if made.world_size > 1:
            raise ConveyorValueError("ConveyorStrategy runs in one process: Lightning's checkpoints would hold only "
                                     "process 0's stages across processes; run the script as one process (conveyor "
                                     "still splits the model across devices=N of this machine)")
        # Read first from the instance's __dict__, so `self.<name>` is the conveyor.Module,
        # while the module tree (_modules: state_dict, parameters, checkpoints) keeps the model.
        lightning_module.__dict__[name] = made

    def teardown(self) -> None:
        if self.lightning_module is not None and self.conveyor_model is not None:
            for name, value in list(vars(self.lightning_module).items()):
                if value is self.conveyor_model:
                    del self.lightning_module.__dict__[name]
        super().teardown()

    def _model_attribute(self, lightning_module) -> str:
        children = lightning_module._modules
        if self.attribute is not None:
            if not isinstance(children.get(self.attribute), torch.nn.Module):
                raise ConveyorValueError(f"ConveyorStrategy(attribute={self.attribute!r}): the LightningModule has no "
                                         f"such child module; its children are {list(children)}")
            return self.attribute
        if len(children) != 1:
            raise ConveyorValueError(f"ConveyorStrategy: the LightningModule has {len(children)} child modules "
                                     f"({list(children)}); name the one training_step calls: "
                                     "ConveyorStrategy(attribute='model')")
        return next(iter(children))
