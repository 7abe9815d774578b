"""vLLM general plugin: serve ``mxfp4conv convert --to marlin`` outputs without vLLM's Marlin repack.

Registered under the ``vllm.general_plugins`` entry point group (``pip install 'mxfp4conv[vllm]'``
next to vLLM). For a checkpoint whose ``quantization_config`` carries the ``mxfp4conv_marlin``
marker it registers the ``mxfp4conv_marlin`` quantization method: FP4 FusedMoE and Linear layers
get parameters at the prepared Marlin shapes, the rank's tensors are copied in as they are, and
vLLM's Marlin experts / Marlin linear kernel run them. Other checkpoints are not touched.

This subpackage imports vLLM and torch; nothing else in mxfp4conv imports it.
"""

from __future__ import annotations

import logging

TESTED = ((0, 32), (0, 33))  # vLLM major.minor releases this plugin was checked against
NAME = "mxfp4conv_marlin"

log = logging.getLogger(__name__)


def vllm_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def is_tested(version: str) -> bool:
    try:
        major, minor = (int(p) for p in version.split("+")[0].split(".")[:2])
    except ValueError:
        return False
    return (major, minor) in TESTED


def register() -> None:
    """Entry point of ``vllm.general_plugins``; vLLM calls it in every process, maybe more than once."""
    version = vllm_version()
    if not is_tested(version):
        _register_refusal(version)
        return
    from mxfp4conv.vllm_plugin import config, loading

    config.register()
    loading.install()


def _register_refusal(version: str) -> None:
    """An untested vLLM: Marlin-ready checkpoints get a one-line error; other checkpoints load as usual."""
    tested = "-".join(f"{a}.{b}" for a, b in (TESTED[0], TESTED[-1]))
    message = (f"mxfp4conv's Marlin-ready loader is tested with vLLM {tested}, this is vLLM {version}: install a tested "
               "vLLM or serve the checkpoint mxfp4conv converted from")
    try:
        from vllm.model_executor.layers.quantization import register_quantization_config
        from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
    except ImportError:
        log.warning(message)
        return

    class _Refuse(QuantizationConfig):
        """Claims Marlin-ready checkpoints only to stop them when the model is built (vLLM shows that line)."""

        @classmethod
        def override_quantization_method(cls, hf_quant_cfg: object, user_quant: object, hf_config: object = None,
                                         **_: object) -> str | None:
            return NAME if isinstance(hf_quant_cfg, dict) and NAME in hf_quant_cfg else None

        @classmethod
        def get_name(cls) -> str:
            return NAME

        @classmethod
        def get_supported_act_dtypes(cls) -> list[object]:
            import torch

            return [torch.bfloat16, torch.float16, torch.float32]

        @classmethod
        def get_min_capability(cls) -> int:
            return 0

        @staticmethod
        def get_config_filenames() -> list[str]:
            return []

        @classmethod
        def from_config(cls, config: dict[str, object]) -> _Refuse:
            return cls()

        def get_quant_method(self, layer: object, prefix: str) -> None:
            raise ValueError(message)

    register_quantization_config(NAME)(_Refuse)
