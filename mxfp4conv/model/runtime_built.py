"""Modules the serving runtime builds unquantized whatever the source's quantization config says.

vLLM's model code builds some modules with ``quant_config=None`` (or as a plain ``nn.Linear``), so a
config's main scheme never reaches them. A BF16 module there is what the runtime builds, not a
contradiction: the plan accepts it, and the writers name it among the unquantized modules of the
output's config (compressed-tensors ``ignore``, Quark ``exclude``), so every runtime reading the output
builds it unquantized without a special case of its own. A BF16 module the runtime would build with the
config's scheme is still refused (``precision._cross_check``).

Each entry cites the vLLM file and what it does there. ``architectures``: the config.json
``architectures[0]`` values served by that file (empty: every model with MoE blocks); ``method``: the
vLLM quantization method the exemption depends on (None: any). Pure: no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["EXEMPTIONS", "Exemption", "runtime_unquantized"]

_QWEN35 = ("Qwen3_5MoeForConditionalGeneration", "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForCausalLM",
           "Qwen3_5ForCausalLM")
_DEEPSEEK = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM")


@dataclass(frozen=True)
class Exemption:
    """A module name pattern (``re.search``) vLLM builds unquantized, and where it does so."""

    pattern: str
    where: str  # the vLLM file (under vllm/), and the module built there
    what: str  # what that code does
    architectures: tuple[str, ...] = ()
    method: str | None = None
    in_moe_block: bool = False  # the pattern names a child of a MoE block (the experts' parent)


EXEMPTIONS: tuple[Exemption, ...] = (
    Exemption(r"^(gate|router|router\.layer)$", "model_executor/models/qwen3_next.py, deepseek_v2.py: the MoE router",
              "ReplicatedLinear(..., quant_config=None) (Qwen3NextSparseMoeBlock); GateLinear, no quant_config "
              "(DeepseekV2MoE)", in_moe_block=True),
    Exemption(r"^shared_expert_gate$", "model_executor/models/qwen3_next.py: Qwen3NextSparseMoeBlock.shared_expert_gate "
              "(Qwen3-Next, Qwen3.5 reuse it)", "ReplicatedLinear(hidden, 1, quant_config=None)", in_moe_block=True),
    Exemption(r"(^|\.)(lm_head|head|output)$", "model_executor/layers/vocab_parallel_embedding.py: ParallelLMHead",
              "a VocabParallelEmbedding, not a LinearBase: a scheme by class never reaches it, only a config naming it"),
    Exemption(r"^mtp\.fc$", "model_executor/models/qwen3_5_mtp.py, qwen3_next_mtp.py: the MTP input projection fc",
              "fc_quant = None if quant_config.get_name() == 'modelopt_fp4' (BF16 in NVIDIA's NVFP4 exports but "
              "missing from exclude_modules; vLLM PR 38650, Model-Optimizer PR 1124)",
              architectures=(*_QWEN35, "Qwen3NextForCausalLM"), method="modelopt_fp4"),
    Exemption(r"(^|\.)layers\.\d+\.eh_proj$", "model_executor/models/deepseek_mtp.py, glm4_moe_mtp.py: the MTP "
              "eh_proj", "a plain nn.Linear(2 * hidden, hidden): no quant_config at all",
              architectures=(*_DEEPSEEK, "Glm4MoeForCausalLM")),
    Exemption(r"\.indexer\.(wk|weights_proj)$", "model_executor/models/deepseek_v2.py: Indexer.wk_weights_proj",
              "wk and weights_proj fused into one MergedColumnParallelLinear(quant_config=None) (an FP8 wk is upcast "
              "to BF16 at load); wq_b keeps the config's scheme", architectures=("DeepseekV32ForCausalLM",)),
    Exemption(r"^(vision_model|multi_modal_projector)\.", "model_executor/models/mllama4.py: "
              "Llama4ForConditionalGeneration", "Llama4VisionModel(config.vision_config, None, ...) and "
              "Llama4MultiModalProjector(config, None, ...)", architectures=("Llama4ForConditionalGeneration",)),
)


def _applies(e: Exemption, architecture: str, method: str | None) -> bool:
    return (not e.architectures or architecture in e.architectures) and (e.method is None or e.method == method)


def runtime_unquantized(module: str, moe_blocks: Iterable[str], *, architecture: str = "",
                        method: str | None = None) -> Exemption | None:
    """The entry under which vLLM builds ``module`` unquantized for this architecture and quantization
    method, or None. ``moe_blocks``: the parents of the source's experts containers (``...mlp``)."""
    blocks = tuple(moe_blocks)
    for e in EXEMPTIONS:
        if not _applies(e, architecture, method):
            continue
        if e.in_moe_block:
            if any(module.startswith(b + ".") and re.search(e.pattern, module[len(b) + 1:]) for b in blocks):
                return e
        elif re.search(e.pattern, module):
            return e
    return None
