"""Images in prompt rows, and a built-in task that needs them.

A row's message `content` may be a list of parts, as transformers' processors take them:
`{"type": "text", "text": ...}` and `{"type": "image", "image": PATH}`. A relative PATH is
resolved against the dataset file's folder; each image is opened when the dataset loads, so a
missing or unreadable one is named by file and line before anything runs.

`write_count_task` draws the "how many red squares?" task: each image holds 1-4 red squares and
some blue ones, so the answer is in the image and not in the text (a text-only model is at
chance, 1 in 4). Its `answer` (the count alone) is also an SFT target. For an ablation it writes
the same rows with blank images.
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

from reroll.config.errors import ConfigError

QUESTION = "How many red squares are in the image? Answer with a number."
COUNTS = (1, 2, 3, 4)


def image_parts(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The `{"type": "image"}` parts of the messages' list contents, in order."""
    return [part for m in messages if isinstance(m.get("content"), list)
            for part in m["content"] if isinstance(part, dict) and part.get("type") == "image"]


def content_text(content: str | list[dict[str, Any]]) -> str:
    """A message content as text for people: an image part shows as `<image>`."""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") if part.get("type") == "text" else "<image>"
                   for part in content)


def check_parts(messages: list[dict[str, Any]], base: Path | None, where: str
                ) -> list[dict[str, Any]]:
    """The messages with every list content checked (text and image parts only) and each image
    path made absolute (against `base`, the dataset's folder) and opened: a ConfigError naming
    `where` (file:line) and the image otherwise."""
    out = []
    for m in messages:
        if not isinstance(m.get("content"), list):
            out.append(m)
            continue
        parts = []
        for part in m["content"]:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                parts.append(part)
            elif kind == "image" and isinstance(part.get("image"), str):
                path = Path(part["image"]).expanduser()
                path = path if path.is_absolute() or base is None else base / path
                open_image(path, where)
                parts.append({**part, "image": str(path)})
            else:
                raise ConfigError(f"{where}: a content part must be {{\"type\": \"text\", "
                                  f"\"text\": str}} or {{\"type\": \"image\", \"image\": path}}, "
                                  f"got {str(part)[:80]}")
        out.append({**m, "content": parts})
    return out


def open_image(path: str | Path, where: str = ""):
    """The image at `path` as an RGB PIL image; a ConfigError naming `where` and the path if it
    is missing or not an image."""
    from PIL import Image, UnidentifiedImageError

    prefix = f"{where}: " if where else ""
    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except FileNotFoundError:
        raise ConfigError(f"{prefix}image {path} does not exist") from None
    except (UnidentifiedImageError, OSError) as e:
        raise ConfigError(f"{prefix}image {path} cannot be read ({type(e).__name__})") from None


def load_images(messages: list[dict[str, Any]]) -> list:
    """The PIL images of the messages' image parts, in order (paths checked at load); a part
    marked with `max_pixels` (by `limit_images`) is scaled down to it, aspect kept."""
    images = []
    for part in image_parts(messages):
        image = open_image(part["image"])
        if part.get("max_pixels"):
            image = image.resize(fitted_size(image.size, part["max_pixels"]))
        images.append(image)
    return images


def fitted_size(size: tuple[int, int], max_pixels: int) -> tuple[int, int]:
    """`size` (width, height) scaled down to at most `max_pixels`, aspect kept (each side at
    least 1); unchanged if it fits."""
    width, height = size
    if width * height <= max_pixels:
        return size
    scale = math.sqrt(max_pixels / (width * height))
    return max(1, int(width * scale)), max(1, int(height * scale))


def limit_images(field: str, rows: list, max_pixels: int | None, mode: str) -> None:
    """`data.max_image_pixels` on loaded rows: an image with more pixels is refused (a
    ConfigError naming the row's file:line, the image and its size) when `mode` is `refuse`, or
    its part marked to be scaled down when opened (`resize`: the path stays, for the viewer)."""
    if max_pixels is None:
        return
    from PIL import Image

    for row in rows:
        for part in image_parts(row.messages):
            with Image.open(part["image"]) as image:  # reads the header only
                width, height = image.size
            if width * height <= max_pixels:
                continue
            if mode == "refuse":
                raise ConfigError(
                    f"{row.source}: image {part['image']} is {width}x{height} = "
                    f"{width * height} pixels, over data.max_image_pixels={max_pixels} ({field}; "
                    f"data.oversize_images=resize scales it down instead)")
            part["max_pixels"] = max_pixels


def draw_count_image(count: int, rng: random.Random, size: int = 64):
    """`count` red and 0-2 blue 10x10 squares on white, none overlapping."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (size, size), "white")
    draw = ImageDraw.Draw(image)
    cells = rng.sample([(x, y) for x in range(4) for y in range(4)], count + rng.randint(0, 2))
    for k, (x, y) in enumerate(cells):
        left, top = x * 16 + rng.randint(1, 5), y * 16 + rng.randint(1, 5)
        draw.rectangle([left, top, left + 9, top + 9], fill="red" if k < count else "blue")
    return image


def count_rows(n: int, seed: int, folder: Path, prefix: str, blank: bool = False
               ) -> list[dict[str, Any]]:
    """`n` rows of the counting task, their images written to `folder/images/`; `blank`: every
    image plain white, the rows and answers those of the same seed otherwise."""
    from PIL import Image

    rng = random.Random(seed)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        count = rng.choice(COUNTS)
        name = f"images/{prefix}_{i}.png"
        image = draw_count_image(count, rng)
        (Image.new("RGB", image.size, "white") if blank else image).save(folder / name)
        content = [{"type": "image", "image": name}, {"type": "text", "text": QUESTION}]
        rows.append({"messages": [{"role": "user", "content": content}], "answer": str(count)})
    return rows


def write_count_task(out: str | Path, train_size: int = 2000, eval_size: int = 100,
                     seed: int = 0, blank: bool = False) -> dict[str, Path]:
    """train.jsonl and eval.jsonl of the counting task in `out`, images in `out/images/`
    (`blank`: `count_rows`)."""
    from reroll.data.tasks import write_splits

    out = Path(out)
    return write_splits(out, {
        "train": count_rows(train_size, seed, out, "train", blank),
        "eval": count_rows(eval_size, seed + 1, out, "eval", blank)})
