"""What a video part may be, on both sides of the wire: the gateway checks and keys it (gateway/videos.py), the
workers decode it (engine_ext/video_decoder.py), and both must read the same file the same way.

- The containers: MP4/QuickTime, Matroska/WebM and AVI, named by their first bytes (:func:`demuxer_of`) and opened
  with that demuxer alone: FFmpeg's probing would also take playlists (HLS, concat) that name other files or URLs.
- The codecs (:data:`CODECS`), and FFmpeg's ``codec_whitelist`` of their software decoders (:data:`DECODERS`), so
  that FFmpeg opens no other decoder, not even to probe a stream nobody will decode.
"""

from __future__ import annotations

import av

CODECS = frozenset({"h264", "hevc", "vp8", "vp9", "av1", "mpeg4", "mjpeg"})
MP4_BOXES = (b"ftyp", b"moov", b"mdat", b"free", b"wide", b"skip")  # what an MP4/QuickTime file may begin with
HARDWARE = av.codec.Capabilities.hardware | av.codec.Capabilities.hybrid  # decoders on a device, not here


def demuxer_of(head: bytes) -> str:
    """The FFmpeg demuxer ("mp4", "matroska" or "avi") for a video whose first bytes are ``head``; ValueError for
    anything else."""
    if head[4:8] in MP4_BOXES:
        return "mp4"
    if head[:4] == b"\x1a\x45\xdf\xa3":
        return "matroska"
    if head[:4] == b"RIFF" and head[8:12] == b"AVI ":
        return "avi"
    raise ValueError("video data is not MP4, WebM/Matroska or AVI")


def decoder_names(codecs: frozenset[str] = CODECS) -> str:
    """FFmpeg's ``codec_whitelist`` for ``codecs``: every software decoder of them (FFmpeg's own, dav1d, libvpx)."""
    wanted = {av.Codec(name, "r").id for name in codecs}
    names = set()
    for name in av.codecs_available:
        try:
            codec = av.Codec(name, "r")
        except (ValueError, av.FFmpegError):  # an encoder only
            continue
        if codec.type == "video" and codec.id in wanted and not codec.capabilities & HARDWARE:
            names.add(codec.name)
    return ",".join(sorted(names))


DECODERS = decoder_names()
