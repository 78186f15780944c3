"""A decoding process of :class:`leafpy.sources.decoding.Processes`: ``main([H, W, C])`` (as
:data:`leafpy.sources.decoding.WORKER` runs it, or ``python -m leafpy.sources.decode_worker H W C``) writes
``ready`` once it can decode, then answers each request on its input, one JSON line (a list of image paths), with
one JSON line (the request's files that could not be decoded: position -> message, or null where decoding raised
something other than a LeafpyError, which the process that asked meets again decoding that file itself) followed
by the bytes of the others' images, uint8 [C, H, W] each, in order. Its answers have its standard output to
themselves: what anything else prints there goes to its standard error. It ends at the end of its input (when the
process that started it closes the pipe, or ends); a Ctrl-C, which reaches every process of the terminal, is left
to that process."""

from __future__ import annotations

import json
import os
import signal
import sys


def main(args: list[str]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "SIGPIPE"):  # (an answer nobody reads, its run killed: ended quietly, as a command in a pipe)
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # (a print, here or in a library, goes to standard error)
    from leafpy.errors import LeafpyError
    from leafpy.sources.image_folder import _pil, decode

    _pil()[0].preinit()  # Pillow's common formats, before the first request rather than during it

    size, channels = (int(args[0]), int(args[1])), int(args[2])
    requests = sys.stdin.buffer
    answers.write(b"ready\n")
    answers.flush()
    for line in requests:
        errors: dict[int, str | None] = {}
        images = []
        for i, path in enumerate(json.loads(line)):
            try:
                images.append(decode(path, size, channels).tobytes())
            except LeafpyError as e:
                errors[i] = str(e)
            except Exception:  # (a decoder's own failure: the process that asked decodes the file, and meets it)
                errors[i] = None
        answers.write(json.dumps(errors).encode() + b"\n")
        for image in images:  # (one at a time: no copy of the whole answer)
            answers.write(image)
        answers.flush()


if __name__ == "__main__":
    main(sys.argv[1:])
