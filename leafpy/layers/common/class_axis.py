"""The class-axis check shared by Softmax and LogSoftmax."""

from __future__ import annotations

from ...errors import ShapeError
from ..layer import Worker


class ClassAxisWorker(Worker):
    backward_reads_output = True
    master_precision_outputs = True

    def output_shapes(self, input_shapes):
        if len(input_shapes[0]) < 2:
            raise ShapeError(f"{self.where}: expected an input [N, C, ...] with a class axis, "
                             f"got shape {tuple(input_shapes[0])}")
        return [tuple(input_shapes[0])]
