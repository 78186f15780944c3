"""LogSoftmax over the class axis (``axis``, 1 by default) of each sample: log(softmax(x)), computed stably."""

from __future__ import annotations

from ..layer import register_layer
from .class_axis import ClassAxisWorker, LogSoftmaxConfig


@register_layer("LogSoftmax", LogSoftmaxConfig)
class LogSoftmax(ClassAxisWorker):
    def forward(self, backend, x, w, y):
        backend.log_softmax(*self.views(backend, x[0], y[0]))

    def backward_input(self, backend, x, y, dy, w, dx):
        backend.log_softmax_grad(*self.views(backend, y[0], dy[0], dx[0]))
