"""Where the experts are in an mlx-lm model, and how one expert lies in a store block.

mlx-lm keeps the routed experts of a layer in one `SwitchGLU` (gate/up/down) or
`SwitchMLP` (fc1/fc2) module whose projections hold stacked `[num_experts, ...]`
tensors. Those tensors are what the store streams; every other parameter stays
resident. Anything else that looks like experts is refused rather than guessed at.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchGLU, SwitchLinear, SwitchMLP

from ...shared.store_format import (
    DTYPE_SIZES,
    EXPERT_ALIGN,
    TENSOR_ALIGN,
    StoreError,
    TensorSpec,
    align_up,
)

# Projections in the order their tensors lie in an expert block.
PROJECTIONS = {SwitchGLU: ("gate_proj", "up_proj", "down_proj"), SwitchMLP: ("fc1", "fc2")}
# Per-expert tensors of one projection, in block order.
TENSOR_NAMES = ("weight", "scales", "biases", "bias", "global_scale")

_PER_EXPERT_MODULE = re.compile(r"(^|\.)experts\.\d+(\.|$)")


@dataclass
class SwitchLayer:
    """One Switch module: its stacked tensors (lazy until written) and their layout."""

    module_path: str
    kind: str
    num_experts: int
    names: tuple[str, ...]  # e.g. "gate_proj.weight", in block order
    arrays: list[mx.array]  # stacked, [num_experts, ...]; emptied once written
    specs: tuple[TensorSpec, ...]
    stride: int
    quantization: dict[str, dict[str, Any] | None]

    @property
    def expert_bytes(self) -> int:
        last = self.specs[-1]
        return last.offset + last.nbytes

    @property
    def file_bytes(self) -> int:
        return self.num_experts * self.stride

    def parameter_names(self) -> list[str]:
        """The model parameter names these tensors replace, e.g. `...switch_mlp.fc1.weight`."""
        return [f"{self.module_path}.{n}" for n in self.names]


def dtype_name(dtype: mx.Dtype) -> str:
    name = str(dtype).rsplit(".", 1)[-1]
    if name not in DTYPE_SIZES:
        raise StoreError(f"expert tensors of dtype {name} are not supported by the store format")
    return name


def _natural_key(path: str) -> list[Any]:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", path)]


def _projection_quantization(proj: nn.Module) -> dict[str, Any] | None:
    if isinstance(proj, QuantizedSwitchLinear):
        q: dict[str, Any] = {"group_size": proj.group_size, "bits": proj.bits, "mode": proj.mode}
        if getattr(proj, "global_scale", None) is not None:
            q["global_scale"] = True
        return q
    return None


def beside_experts(module: nn.Module) -> list[str]:
    """Modules with weights that a SwitchGLU/SwitchMLP holds beside its projections, one
    copy for every expert (muse_spark keeps its post-expert norm there, called by the MoE
    block around it): resident weights, not part of an expert's read. A child stacked
    over the experts (a leading axis of the expert count) is not one of them."""
    kind_class = next((c for c in PROJECTIONS if isinstance(module, c)), None)
    projections = PROJECTIONS.get(kind_class, ()) if kind_class is not None else ()
    prefixes = tuple(f"{p}." for p in projections)
    counts = {int(a.shape[0]) for k, a in tree_flatten(module.parameters()) if k.startswith(prefixes) and a.ndim}
    out = []
    for name, child in module.children().items():
        if name in projections or not isinstance(child, nn.Module):
            continue
        arrays = [a for _, a in tree_flatten(child.parameters())]
        if arrays and not any(a.ndim >= 2 and int(a.shape[0]) in counts for a in arrays):
            out.append(name)
    return out


def describe_switch(module_path: str, module: nn.Module) -> SwitchLayer:
    """The layout of one SwitchGLU/SwitchMLP; StoreError if it is not the known shape."""
    kind_class = next((c for c in PROJECTIONS if isinstance(module, c)), None)
    if kind_class is None:
        raise StoreError(f"{module_path}: {type(module).__name__} is not a SwitchGLU or SwitchMLP")
    projections = PROJECTIONS[kind_class]
    where = f"{module_path} ({type(module).__name__})"

    params = dict(tree_flatten(module.parameters()))
    expected_prefixes = tuple(f"{p}." for p in projections)
    beside = tuple(f"{name}." for name in beside_experts(module))
    unknown = sorted(k for k in params if not k.startswith(expected_prefixes + beside))
    if unknown:
        raise StoreError(
            f"unknown expert layout at {where}: parameters {unknown} are not in the "
            f"projections {list(projections)} moestream knows; this model is not supported"
        )
    names: list[str] = []
    arrays: list[mx.array] = []
    quantization: dict[str, dict[str, Any] | None] = {}
    num_experts: int | None = None
    for proj_name in projections:
        proj = getattr(module, proj_name, None)
        if not isinstance(proj, (SwitchLinear, QuantizedSwitchLinear)):
            found = type(proj).__name__ if proj is not None else "nothing"
            raise StoreError(
                f"unknown expert layout at {where}: {proj_name} is {found}, "
                "expected a SwitchLinear or QuantizedSwitchLinear"
            )
        proj_params = dict(tree_flatten(proj.parameters()))
        extra = sorted(set(proj_params) - set(TENSOR_NAMES))
        if extra or "weight" not in proj_params:
            raise StoreError(
                f"unknown expert layout at {where}.{proj_name}: tensors {sorted(proj_params)}; "
                f"expected weight plus any of {list(TENSOR_NAMES[1:])}"
            )
        for t in TENSOR_NAMES:
            if t not in proj_params:
                continue
            a = proj_params[t]
            if a.ndim < 1 or (num_experts is not None and a.shape[0] != num_experts):
                raise StoreError(
                    f"unknown expert layout at {where}: {proj_name}.{t} has shape {tuple(a.shape)}, "
                    f"not stacked over {num_experts} experts"
                )
            num_experts = a.shape[0]
            names.append(f"{proj_name}.{t}")
            arrays.append(a)
        quantization[proj_name] = _projection_quantization(proj)

    assert num_experts is not None  # every projection has a weight
    specs = tensor_specs(names, arrays)
    last = specs[-1]
    stride = align_up(last.offset + last.nbytes, EXPERT_ALIGN)
    return SwitchLayer(
        module_path=module_path,
        kind=kind_class.__name__,
        num_experts=num_experts,
        names=tuple(names),
        arrays=arrays,
        specs=specs,
        stride=stride,
        quantization=quantization,
    )


def tensor_specs(names: list[str], arrays: list[mx.array]) -> tuple[TensorSpec, ...]:
    """Per-expert tensors laid back to back, each at a TENSOR_ALIGN offset."""
    specs = []
    offset = 0
    for name, a in zip(names, arrays):
        dtype = dtype_name(a.dtype)
        shape = tuple(int(s) for s in a.shape[1:])
        nbytes = math.prod(shape) * DTYPE_SIZES[dtype]
        offset = align_up(offset, TENSOR_ALIGN)
        specs.append(TensorSpec(name=name, dtype=dtype, shape=shape, offset=offset, nbytes=nbytes))
        offset += nbytes
    return tuple(specs)


def find_switch_layers(model: nn.Module, model_type: str = "model") -> list[SwitchLayer]:
    """Every SwitchGLU/SwitchMLP of `model`, in layer order, described.

    Raises StoreError for a model with no MoE layers, or with experts kept in a layout
    the store cannot stream (one module per expert, unknown projections).
    """
    modules = model.named_modules()
    per_expert = sorted((p for p, _ in modules if _PER_EXPERT_MODULE.search(p)), key=_natural_key)
    if per_expert:
        raise StoreError(
            f"unknown expert layout: this {model_type} model keeps one module per expert "
            f"({per_expert[0]}, ...); moestream streams experts stacked in mlx-lm's "
            "SwitchGLU/SwitchMLP layers, so it cannot convert this model"
        )
    switches = sorted(
        ((p, m) for p, m in modules if isinstance(m, (SwitchGLU, SwitchMLP))),
        key=lambda pm: _natural_key(pm[0]),
    )
    if not switches:
        raise StoreError(
            f"this {model_type} model has no MoE layers (no SwitchGLU/SwitchMLP modules), so "
            "there are no experts to stream; run it with mlx-lm directly"
        )
    return [describe_switch(p, m) for p, m in switches]
