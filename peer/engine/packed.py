"""bfloat16 linear layers with their weights laid out once for oneDNN, swapped in for a
bfloat16 model's nn.Linear on the CPU.

torch's bfloat16 `F.linear` on the CPU runs oneDNN's product, but lays the weight out for
it again at every call. For a decode's few rows that relayout is most of the call: on an
AMD EPYC (avx512_bf16) SmolLM2's 49,152 x 576 output head took 4.4 ms a row through
`F.linear` and 1.5 ms from a weight laid out once, its projections about half. The
product is the same oneDNN kernel either way, so the outputs are the same bits as
`F.linear`'s (a test holds this at every row count): a peer that packs and one that does
not compute the same answers, and the model id does not change.

The laid-out weight is oneDNN's opaque tensor, so the module keeps it alone (no second
copy of the weights) and gives the plain weight back where one is asked for: the state
dict, which the model id's fingerprint hashes, and `weight`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

PACKED_DTYPE = torch.bfloat16


def packing_available() -> bool:
    """Whether this torch has oneDNN and its laid-out linear on the CPU."""
    mkldnn = torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
    return (bool(mkldnn)
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class PackedLinear(nn.Module):
    """y = x W^T (+ b), W laid out for oneDNN once; x and W in bfloat16 on the CPU."""

    bias: nn.Parameter | None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        if weight.dtype != PACKED_DTYPE or weight.device.type != "cpu":
            raise ValueError(f"PackedLinear takes a {PACKED_DTYPE} CPU weight, not "
                             f"{weight.dtype} on {weight.device}")
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])
        self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @property
    def weight(self) -> torch.Tensor:
        """The plain [out, in] weight (a copy: for readers, not for the product)."""
        dense: torch.Tensor = self._packed.to_dense()
        return dense

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if not flat.is_contiguous():
            flat = flat.contiguous()
        y: torch.Tensor = torch.ops.mkldnn._linear_pointwise(flat, self._packed, self.bias,
                                                             "none", [], "")
        return y.reshape(*x.shape[:-1], self.out_features)

    def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
        destination[prefix + "weight"] = self.weight
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias if keep_vars else self.bias.detach()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, oneDNN layout")


def pack_linears(model: Any) -> int:
    """Swap every bfloat16 CPU nn.Linear of `model` for a PackedLinear, in place; a tied
    output head gets its own laid-out copy (the embedding keeps the plain weight). Returns
    how many were swapped; 0 where oneDNN's laid-out linear is missing."""
    if not packing_available():
        return 0
    swaps = [(name, module) for name, module in model.named_modules()
             if isinstance(module, nn.Linear) and module.weight.dtype == PACKED_DTYPE
             and module.weight.device.type == "cpu"]
    for name, linear in swaps:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, PackedLinear(linear.weight, linear.bias))
    return len(swaps)
