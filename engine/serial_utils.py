"""msgspec msgpack encoding for the EngineCore wire, with large arrays as extra zero-copy ZMQ frames."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np
import zmq

# Ext type codes. The payload is msgpack (dtype, shape, data): data is the raw bytes of a
# small array (inline), or the index of the extra frame that holds a large one.
_EXT_NUMPY = 1
_EXT_TORCH = 2

# Arrays of at most this many bytes travel inline in frame 0; larger ones as their own frames.
DEFAULT_SIZE_THRESHOLD = 256

_BufferLike = bytes | bytearray | memoryview | zmq.Frame


class MsgpackEncoder:
    """Encodes one message into frames: frame 0 is msgpack, frames 1.. are large array buffers.

    Frame 0 is written into one reusable bytearray. Invariant: that bytearray is never
    overwritten while ZMQ may still read it. `send()` hands frame 0 to ZMQ zero-copy with a
    MessageTracker on *that* frame (not the message's last one); the next `encode()` reuses the
    buffer only if the tracker says ZMQ is done, and otherwise starts a fresh buffer, leaving
    the old one to ZMQ (pyzmq keeps it alive until libzmq frees the message). Frames from a
    bare `encode()` are valid only until the next `encode()`: send them copied, or use `send()`.
    Extra array frames point into the arrays themselves, so a sent array must not be mutated.
    One encoder per thread.
    """

    def __init__(self, size_threshold: int = DEFAULT_SIZE_THRESHOLD) -> None:
        self.size_threshold = size_threshold
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._header_encoder = msgspec.msgpack.Encoder()
        self._buffer = bytearray()
        self._buffer_tracker: zmq.MessageTracker | None = None  # None: nobody else reads _buffer
        self._aux_frames: list[memoryview] = []

    def encode(self, obj: Any) -> list[bytearray | memoryview]:
        if self._buffer_tracker is not None and not self._buffer_tracker.done:
            self._buffer = bytearray(len(self._buffer))  # ZMQ still reads the old one
        self._buffer_tracker = None
        self._aux_frames = []
        try:
            self._encoder.encode_into(obj, self._buffer)
            return [self._buffer, *self._aux_frames]
        finally:
            self._aux_frames = []

    def send(self, socket: zmq.Socket, obj: Any, prefix: Sequence[bytes] = ()) -> None:
        """Encodes obj and sends it as one multipart message (after any `prefix` frames)."""
        frames = self.encode(obj)
        # Small frames are copied by pyzmq (its tracker starts done); large ones are shared.
        first = zmq.Frame(frames[0], track=True)
        socket.send_multipart([*prefix, first, *frames[1:]], copy=False)
        self._buffer_tracker = first.tracker

    def _enc_hook(self, obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            return self._array_ext(_EXT_NUMPY, obj.dtype.str, obj)
        torch = _torch_if_loaded()
        if torch is not None and isinstance(obj, torch.Tensor):
            if obj.device.type != "cpu":
                raise TypeError(f"only CPU tensors can be sent, got one on {obj.device}")
            dtype = str(obj.dtype).removeprefix("torch.")
            raw = obj.detach().contiguous().view(-1).view(torch.uint8).numpy()  # any dtype, as bytes
            return self._array_ext(_EXT_TORCH, dtype, raw, tuple(obj.shape))
        raise NotImplementedError(f"cannot encode objects of type {type(obj).__name__}")

    def _array_ext(self, code: int, dtype: str, arr: np.ndarray, shape: tuple | None = None) -> msgspec.msgpack.Ext:
        shape = arr.shape if shape is None else shape
        if arr.dtype.hasobject:
            raise TypeError("object arrays cannot be sent")
        if arr.nbytes <= self.size_threshold:
            data: bytes | int = arr.tobytes()
        else:
            arr = np.ascontiguousarray(arr)  # a view when already contiguous
            self._aux_frames.append(memoryview(arr.reshape(-1)).cast("B"))
            data = len(self._aux_frames)  # frame index: frame 0 is the msgpack body
        return msgspec.msgpack.Ext(code, self._header_encoder.encode((dtype, shape, data)))


class MsgpackDecoder:
    """Decodes the frames of one message into `type`; large arrays are views of their frames.

    Arrays are zero-copy and read-only (they share the received frame's memory).
    One decoder per thread.
    """

    def __init__(self, type: Any = Any) -> None:
        self._decoder = msgspec.msgpack.Decoder(type, ext_hook=self._ext_hook, dec_hook=self._dec_hook)
        self._frames: Sequence[_BufferLike] = ()

    def decode(self, frames: Sequence[_BufferLike] | _BufferLike) -> Any:
        if not isinstance(frames, (list, tuple)):
            frames = [frames]
        self._frames = frames
        try:
            return self._decoder.decode(_as_buffer(frames[0]))
        finally:
            self._frames = ()

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        dtype, shape, payload = msgspec.msgpack.decode(data)
        raw = _as_buffer(self._frames[payload]) if isinstance(payload, int) else payload
        if code == _EXT_NUMPY:
            return np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape)
        if code == _EXT_TORCH:
            import torch

            with warnings.catch_warnings():  # a received frame is read-only memory
                warnings.simplefilter("ignore", UserWarning)
                flat = torch.frombuffer(raw, dtype=torch.uint8) if len(raw) else torch.empty(0, dtype=torch.uint8)
            return flat.view(getattr(torch, dtype)).reshape(shape)
        raise ValueError(f"unknown msgpack extension type {code}")

    @staticmethod
    def _dec_hook(type: Any, obj: Any) -> Any:
        if type is np.ndarray:
            return obj if isinstance(obj, np.ndarray) else np.asarray(obj)
        raise NotImplementedError(f"cannot decode {type}")


def _as_buffer(frame: _BufferLike) -> bytes | memoryview:
    return frame.buffer if isinstance(frame, zmq.Frame) else frame


def _torch_if_loaded():
    # Only tensors need torch, and a tensor can exist only if torch was imported already.
    import sys

    return sys.modules.get("torch")
