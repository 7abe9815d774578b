"""Route Marlin-ready tensors straight into the plugin's parameters, ahead of the model's own loader.

A model's ``load_weights`` slices experts and fused layers by TP rank and renames them in its own way
(GPT-OSS, for one, views and slices ``w13_weight`` itself). Marlin-ready tensors are already this
rank's, in their final layout, so they must not pass through it: vLLM's default loader is wrapped so
that, for a model with Marlin-ready layers, each such tensor is copied into its parameter as it is
read and every other tensor goes on to the model's ``load_weights`` unchanged.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable
from pathlib import Path
from typing import Any

import torch

from mxfp4conv.vllm_plugin.params import Slot
from mxfp4conv.vllm_plugin.shards import MarlinReadyMismatch

_MARK = "_mxfp4conv_marlin_ready"


def plugin_slots(model: torch.nn.Module) -> tuple[dict[str, Slot], set[str], Path | None]:
    """Checkpoint name -> slot of every Marlin-ready parameter of ``model``, every Marlin tensor name, and the
    rank folder they come from."""
    from mxfp4conv.vllm_plugin.linear import MarlinReadyLinearMethod
    from mxfp4conv.vllm_plugin.moe import MarlinReadyMoEMethod

    slots: dict[str, Slot] = {}
    names: set[str] = set()
    folder = None
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, MarlinReadyMoEMethod | MarlinReadyLinearMethod):
            slots.update(method.targets(module))
            shards = method.cfg.require_shards()
            names |= shards.marlin_names()
            folder = shards.folder
    return slots, names, folder


def route(weights: Iterable[tuple[str, torch.Tensor]], slots: dict[str, Slot], names: set[str]
          ) -> Generator[tuple[str, torch.Tensor], None, None]:
    """Load the Marlin tensors of ``weights`` into ``slots``; yield every other tensor."""
    for name, tensor in weights:
        slot = slots.get(name)
        if slot is not None:
            slot.load(tensor)
        elif name in names:
            raise MarlinReadyMismatch(f"{name}: a Marlin-ready tensor with no Marlin-ready layer in the vLLM model "
                                      "(is the module quantized in this architecture?)")
        else:
            yield name, tensor


def install() -> None:
    """Wrap ``DefaultModelLoader.get_all_weights`` once per process (plugins may be loaded repeatedly)."""
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    original = DefaultModelLoader.get_all_weights
    if getattr(original, _MARK, False):
        return

    def get_all_weights(self: Any, model_config: Any, model: torch.nn.Module
                        ) -> Generator[tuple[str, torch.Tensor], None, None]:
        slots, names, folder = plugin_slots(model)
        if not slots:
            yield from original(self, model_config, model)
            return
        if folder is not None and folder.resolve() != Path(model_config.model).resolve():
            # a TP rank other than the served folder's: every tensor comes from this rank's own folder
            source = DefaultModelLoader.Source(str(folder), None, prefix="", fall_back_to_pt=False)
            weights = self._get_weights_iterator(source)
        else:
            weights = original(self, model_config, model)
        yield from route(weights, slots, names)

    setattr(get_all_weights, _MARK, True)
    get_all_weights.__wrapped__ = original  # type: ignore[attr-defined]
    DefaultModelLoader.get_all_weights = get_all_weights
