"""Softmax over the class axis (``axis``, 1 by default) of each sample."""

from __future__ import annotations

from ..layer import register_layer
from .class_axis import ClassAxisWorker, SoftmaxConfig


@register_layer("Softmax", SoftmaxConfig)
class Softmax(ClassAxisWorker):
    def forward(self, backend, x, w, y):
        backend.softmax(*self.views(backend, x[0], y[0]))

    def backward_input(self, backend, x, y, dy, w, dx):
        backend.softmax_grad(*self.views(backend, y[0], dy[0], dx[0]))
