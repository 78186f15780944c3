"""Shared shape of the elementwise activations: each is a line of the backends' pointwise table
(leafpy/backends/pointwise.py), which gives its forward and gradient formulas. An activation whose gradient reads
its output runs in place over its input; one whose gradient reads its input runs out of place (so the container
keeps the input for the backward pass)."""

from __future__ import annotations

from typing import ClassVar

from ...backends import pointwise
from ..layer import Worker


class ElementwiseActivation(Worker):
    formula: ClassVar[str] = ""
    """The line of pointwise.TABLE this layer computes (see :meth:`line` for layers that choose by config)."""

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if cls.formula:
            reads_output = pointwise.line(cls.formula).reads == "y"
            cls.in_place = reads_output
            cls.backward_reads_output = reads_output

    def line(self) -> str:
        return self.formula

    def params(self) -> tuple[float, ...]:
        """The line's parameters, from the config fields of the same names."""
        return tuple(float(getattr(self.config, name)) for name in pointwise.line(self.line()).params)

    def forward(self, backend, x, w, y):
        backend.activation(self.line(), x[0], y[0], self.params())

    def backward_input(self, backend, x, y, dy, w, dx):
        kind = self.line()
        src = y[0] if pointwise.line(kind).reads == "y" else x[0]
        backend.activation_grad(kind, src, dy[0], dx[0], self.params())
