"""LogSoftmax over the class axis (axis 1) of each sample: log(softmax(x)), computed stably."""

from __future__ import annotations

from ..layer import register_layer
from .class_axis import ClassAxisWorker


@register_layer("LogSoftmax")
class LogSoftmax(ClassAxisWorker):
    def forward(self, backend, x, w, y):
        backend.log_softmax(x[0], y[0])

    def backward_input(self, backend, x, y, dy, w, dx):
        backend.log_softmax_grad(y[0], dy[0], dx[0])
