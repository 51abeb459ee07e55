"""Reading and checking image and audio files without trusting their headers.

Every check returns a reason string (or None) instead of raising, so a validator can report a
broken file as one finding and carry on with the rest. `rgb_conversion` is the one rule for
how an image's mode becomes the 8-bit RGB the image recipes read (the validator, the loader,
the import preview and the data card all ask it).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
from PIL import Image

# Images larger than this are refused rather than decoded (a decompression bomb guard).
MAX_IMAGE_PIXELS = 64_000_000
Image.MAX_IMAGE_PIXELS = MAX_IMAGE_PIXELS

SOUNDFILE_SUBTYPES = {"PCM_16": "int16", "PCM_32": "int32", "FLOAT": "float32"}


def open_image(path: Path) -> tuple[Image.Image | None, str | None]:
    """Open and fully decode an image; (None, reason) when it is not a readable image."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(path)
            image.load()
        return image, None
    except FileNotFoundError:
        return None, "file not found"
    except Exception as exc:  # PIL raises many types for corrupt data; all mean "unreadable"
        return None, f"not a readable image ({type(exc).__name__}: {exc})"


def check_image(image: Image.Image, spec: dict | None) -> str | None:
    """Compare an opened image with the manifest's {"mode", "size"} requirements."""
    if not spec:
        return None
    mode = spec.get("mode")
    if mode and image.mode != mode:
        return f"image mode is {image.mode}, the dataset requires {mode}"
    size = spec.get("size")
    if size and list(image.size) != list(size):
        return f"image size is {image.size[0]}x{image.size[1]}, the dataset requires " \
               f"{size[0]}x{size[1]}"
    return None


# How each PIL mode becomes the 8-bit RGB the image recipes read: one table, read by the
# validator, the loader (engine/train/media_data.read_rgb) and the data card, so what
# `data validate` accepts is exactly what a run reads. Alpha is composited over white (what an
# image viewer shows; dropping it would expose whatever colour sits under transparent pixels,
# often black ink on a black field), 16-bit grey is scaled to 8 bits (v / 257, rounded; PIL's
# own I;16 -> L conversion clips at 255 instead).
RGB_CONVERSIONS = {
    "RGB": None,
    "L": "grey replicated to three channels",
    "1": "black and white replicated to three channels",
    "P": "palette colours looked up (transparency composited over white)",
    "LA": "grey with alpha composited over white",
    "PA": "palette with alpha composited over white",
    "RGBA": "alpha composited over white",
    "RGBa": "alpha composited over white",
    "La": "grey with alpha composited over white",
    "CMYK": "CMYK converted to RGB (PIL's conversion, no colour profile)",
    "YCbCr": "YCbCr converted to RGB",
    "I;16": "16-bit grey scaled to 8 bits and replicated",
    "I;16L": "16-bit grey scaled to 8 bits and replicated",
    "I;16B": "16-bit grey scaled to 8 bits and replicated",
    "I;16N": "16-bit grey scaled to 8 bits and replicated",
    "I": "16-bit grey scaled to 8 bits and replicated",
}


def rgb_conversion(image: Image.Image) -> tuple[str | None, str | None]:
    """(how the image becomes 8-bit RGB or None when it already is, why it cannot), the one
    decision the validator and the loader share."""
    if image.mode not in RGB_CONVERSIONS:
        return None, (f"image mode {image.mode} cannot be read as RGB (supported: "
                      f"{', '.join(RGB_CONVERSIONS)}); save it as an 8-bit RGB or greyscale "
                      "PNG")
    if image.mode == "I":       # 32-bit integers: only the 16-bit range a PNG holds is known
        low, high = image.getextrema()
        if low < 0 or high > 65535:
            return None, (f"32-bit integer image with values {low}..{high}: its range is "
                          "unknown; save it as an 8- or 16-bit PNG")
    return RGB_CONVERSIONS[image.mode], None


def to_rgb(image: Image.Image) -> tuple[Image.Image | None, str | None]:
    """The image as 8-bit RGB per `rgb_conversion`, or (None, reason)."""
    how, reason = rgb_conversion(image)
    if reason:
        return None, reason
    if how is None:
        return image, None
    mode = image.mode
    if mode.startswith("I"):
        grey = np.asarray(image, dtype=np.int64)
        grey = np.clip(np.rint(grey / 257.0), 0, 255).astype(np.uint8)
        return Image.fromarray(np.repeat(grey[..., None], 3, axis=2), "RGB"), None
    has_alpha = mode in ("LA", "PA", "RGBA", "RGBa", "La") or (
        mode == "P" and "transparency" in image.info)
    if has_alpha:
        rgba = image.convert("RGBA")
        canvas = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(canvas, rgba).convert("RGB"), None
    return image.convert("RGB"), None


def mask_array(mask: Image.Image) -> tuple[np.ndarray | None, str | None]:
    """A mask as an integer array [H, W]: binary masks hold 0/255, label masks 0..K-1."""
    if mask.mode not in ("1", "L", "P", "I", "I;16"):
        return None, f"mask mode is {mask.mode}; use a single-channel PNG (L, P or I)"
    array = np.asarray(mask.convert("L") if mask.mode == "1" else mask)
    return array.astype(np.int64), None


def check_binary_mask(array: np.ndarray) -> str | None:
    values = np.unique(array)
    bad = values[(values != 0) & (values != 255)]
    if bad.size:
        return f"binary mask holds values other than 0 and 255 (e.g. {int(bad[0])})"
    return None


def box_from_mask(array: np.ndarray) -> list[float] | None:
    """Normalized [x0, y0, x1, y1] around the foreground, max edge exclusive; None when empty.

    A foreground spanning columns 2..6 of a 10-pixel-wide mask gives x0 = 0.2, x1 = 0.7.
    """
    ys, xs = np.nonzero(array)
    if xs.size == 0:
        return None
    height, width = array.shape
    return [int(xs.min()) / width, int(ys.min()) / height,
            (int(xs.max()) + 1) / width, (int(ys.max()) + 1) / height]


def wav_header_problem(data: bytes) -> str | None:
    """Why a RIFF/WAVE file's header disagrees with its own bytes, or None.

    libsndfile quietly clamps a data chunk that claims more bytes than the file holds; a file
    like that was truncated or hand-edited, so it is reported rather than trusted.
    """
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        return "not a RIFF/WAVE file"
    riff_size = int.from_bytes(data[4:8], "little")
    if riff_size + 8 != len(data):
        return f"RIFF header gives {riff_size + 8} bytes but the file has {len(data)}"
    offset, block_align = 12, None
    while offset + 8 <= len(data):
        chunk, size = data[offset:offset + 4], int.from_bytes(data[offset + 4:offset + 8],
                                                              "little")
        body = data[offset + 8:offset + 8 + size]
        if len(body) < size:
            return f"{chunk.decode('latin-1')!r} chunk claims {size} bytes but only " \
                   f"{len(body)} remain"
        if chunk == b"fmt " and size >= 16:
            channels = int.from_bytes(body[2:4], "little")
            rate = int.from_bytes(body[4:8], "little")
            byte_rate = int.from_bytes(body[8:12], "little")
            block_align = int.from_bytes(body[12:14], "little")
            bits = int.from_bytes(body[14:16], "little")
            if channels == 0 or rate == 0 or block_align != channels * ((bits + 7) // 8) \
                    or byte_rate != rate * block_align:
                return (f"inconsistent fmt chunk (channels {channels}, rate {rate}, bits "
                        f"{bits}, block align {block_align}, byte rate {byte_rate})")
        if chunk == b"data":
            if block_align is None:
                return "data chunk before the fmt chunk"
            if size % block_align:
                return f"data chunk of {size} bytes is not a whole number of frames"
        offset += 8 + size + (size & 1)
    return None


def read_audio(path: Path) -> tuple[np.ndarray | None, int, str | None]:
    """Decode a sound file to float32 [channels, samples]; (None, 0, reason) when unreadable.

    The whole payload is decoded, so a header that promises more frames than the file holds
    is caught here rather than during training.
    """
    import soundfile

    if path.suffix.lower() == ".wav":
        try:
            problem = wav_header_problem(path.read_bytes())
        except OSError as exc:
            return None, 0, f"cannot read ({exc.strerror})"
        if problem:
            return None, 0, f"WAV header does not match the file: {problem}"
    try:
        info = soundfile.info(str(path))
        data, rate = soundfile.read(str(path), dtype="float32", always_2d=True)
    except FileNotFoundError:
        return None, 0, "file not found"
    except Exception as exc:  # libsndfile reports every malformed header as a RuntimeError
        return None, 0, f"not a readable sound file ({type(exc).__name__}: {exc})"
    if data.shape[0] != info.frames:
        return None, 0, (f"header promises {info.frames} frames but the file holds "
                         f"{data.shape[0]}")
    return data.T.copy(), rate, None


def check_audio(path: Path, spec: dict | None) -> tuple[np.ndarray | None, int, str | None]:
    """Decode and compare with the manifest's {"sample_rate", "channels", "subtype", "samples"}."""
    import soundfile

    audio, rate, reason = read_audio(path)
    if reason or not spec:
        return audio, rate, reason
    info = soundfile.info(str(path))
    if spec.get("channels") and info.channels != spec["channels"]:
        return audio, rate, f"{info.channels} channels, the dataset requires {spec['channels']}" \
                            " (mono = 1)"
    if spec.get("sample_rate") and rate != spec["sample_rate"]:
        return audio, rate, (f"sample rate {rate} Hz, the dataset requires "
                             f"{spec['sample_rate']} Hz (resample with filtering; do not "
                             "relabel the header)")
    if spec.get("subtype") and info.subtype != spec["subtype"]:
        return audio, rate, f"sample format {info.subtype}, the dataset requires {spec['subtype']}"
    if spec.get("samples") and audio.shape[1] != spec["samples"]:
        return audio, rate, f"{audio.shape[1]} samples, the dataset requires {spec['samples']}"
    return audio, rate, None
