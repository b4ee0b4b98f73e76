"""`make vlm-demo`: LLaVA-style vision-language training end to end, with nothing downloaded.

1. pictures drawn here with Pillow (a square, circle, triangle or diamond of one of five colours, small or
   large, in one corner of a plain 32x32 picture), each with a caption ("a small red circle at the top left")
   and three questions with one-word or two-word answers (its colour, its shape, its place), in LLaVA's json
   form: a training set and a held-out set of other pictures; and a byte-level BPE tokenizer trained on their
   words, with ChatML's tokens and an <image> token;
2. a small GPT (2 layers, width 64) behind the debug-vit encoder (16 patches of 8x8 pixels, width 32) and
   LLaVA's two-layer projector; the encoder keeps its random weights and is never trained (a stand-in for a
   pretrained CLIP: its features still carry the pixels, and the projector learns to read them);
3. three `paratron train --sft` runs, each from the previous one's checkpoint (`--load ... --finetune`):
   stage 0 the language model alone, on the captions and questions with the scene written out in words
   instead of a picture (LLaVA starts from a pretrained language model); stage 1 the projector alone, on the
   captions (`--freeze-vision-model --freeze-language-model`, LLaVA's feature alignment); stage 2 the projector
   and the language model, on the questions (`--freeze-vision-model`, LLaVA's instruction tuning);
4. before and after each stage: which parts of the model its weights changed, the held-out pictures' captions
   and answers generated greedily (as `paratron generate --image` makes them) and their exact-match accuracy
   per kind of question, with one picture's answers.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image, ImageDraw
from tokenizers import AddedToken

from paratron.checkpoint.load import model_from_checkpoint
from paratron.checkpoint.pretrained import tokenizer_from_checkpoint
from paratron.checkpoint.verify import read_checkpoint
from paratron.config import Config, build_config
from paratron.config.schema import CheckpointConfig
from paratron.data.sft import chat_stop_ids, tokenizer_chat_template
from paratron.data.sft.templates import ChatTemplate
from paratron.data.tokenizer import Tokenizer, train_byte_level_bpe
from paratron.data.vision.images import ImageSettings
from paratron.data.vision.llava import encode_prompt
from paratron.data.vision.settings import image_settings
from paratron.inference.generate import generate
from paratron.model.gpt import GPT, build_model

RUN = Path("runs/vlm-demo")
SIZE = 32  # pixels: debug-vit's image size
BACKGROUND = (235, 235, 235)
COLOURS = {"red": (220, 30, 30), "green": (30, 170, 40), "blue": (30, 60, 220), "yellow": (240, 210, 20),
           "purple": (140, 40, 170)}  # fmt: skip
SHAPES = ("square", "circle", "triangle", "diamond")
SIZES = {"small": 4, "large": 7}  # half the side of the shape's box, in pixels
PLACES = {"top left": (8, 8), "top right": (24, 8), "bottom left": (8, 24), "bottom right": (24, 24)}
SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>", "<image>")
DESCRIBE = "describe the image."
KINDS = ("colour", "shape", "place")
NEW_TOKENS = {"caption": 12, "answer": 4}  # tokens generated: enough for the longest caption or answer and its end


@dataclass(frozen=True)
class Scene:
    """One picture: a shape of one colour and size around a corner's centre (moved by up to 2 pixels)."""

    shape: str
    colour: str
    size: str
    place: str
    shift: tuple[int, int]

    @property
    def caption(self) -> str:
        return f"a {self.size} {self.colour} {self.shape} at the {self.place}"

    @property
    def questions(self) -> dict[str, tuple[str, str]]:
        """kind -> (question, answer)."""
        return {
            "colour": ("what colour is the shape?", self.colour),
            "shape": ("what shape is it?", self.shape),
            "place": ("where is it?", self.place),
        }

    @property
    def prompts(self) -> dict[str, tuple[str, str]]:
        """What the held-out pictures are asked: the caption and the questions."""
        return {"caption": (DESCRIBE, self.caption), **self.questions}


def random_scene(rng: random.Random) -> Scene:
    shape, colour, size, place = (rng.choice(list(options)) for options in (SHAPES, COLOURS, SIZES, PLACES))
    return Scene(shape, colour, size, place, (rng.randint(-2, 2), rng.randint(-2, 2)))


def draw(scene: Scene, path: Path) -> None:
    """The scene as a PNG: the shape filled with its colour on the plain background."""
    image = Image.new("RGB", (SIZE, SIZE), BACKGROUND)
    pen = ImageDraw.Draw(image)
    x, y = (c + s for c, s in zip(PLACES[scene.place], scene.shift, strict=True))
    r, fill = SIZES[scene.size], COLOURS[scene.colour]
    if scene.shape == "square":
        pen.rectangle((x - r, y - r, x + r, y + r), fill=fill)
    elif scene.shape == "circle":
        pen.ellipse((x - r, y - r, x + r, y + r), fill=fill)
    elif scene.shape == "triangle":
        pen.polygon([(x, y - r), (x + r, y + r), (x - r, y + r)], fill=fill)
    else:
        pen.polygon([(x, y - r - 1), (x + r + 1, y), (x, y + r + 1), (x - r - 1, y)], fill=fill)
    image.save(path)


def turn(prompt: str, answer: str, image: str | None = None) -> dict:
    """One sample in LLaVA's form (with no image: the prompt says the scene in words)."""
    sample: dict = {"conversations": [{"from": "human", "value": prompt}, {"from": "gpt", "value": answer}]}
    if image is not None:
        sample = {"image": image, **sample}
    return sample


def write_json(path: Path, samples: list[dict]) -> None:
    path.write_text("[\n" + ",\n".join(json.dumps(sample) for sample in samples) + "\n]\n", encoding="utf-8")


def write_data(folder: Path, train_pictures: int, heldout_pictures: int) -> list[tuple[str, Scene]]:
    """The pictures, the three stages' files and the held-out questions' file; returns the held-out pictures."""
    rng = random.Random(0)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    pictures: list[tuple[str, Scene]] = []
    for index in range(train_pictures + heldout_pictures):
        name = f"images/{index:05d}.png"
        scene = random_scene(rng)
        draw(scene, folder / name)
        pictures.append((name, scene))
    train, heldout = pictures[:train_pictures], pictures[train_pictures:]
    words, captions, questions = [], [], []
    for name, scene in train:
        words.append(turn(f"{scene.caption}\n{DESCRIBE}", scene.caption))
        words += [turn(f"{scene.caption}\n{q}", a) for q, a in scene.questions.values()]
        captions.append(turn(f"<image>\n{DESCRIBE}", scene.caption, name))
        questions += [turn(f"<image>\n{q}", a, name) for q, a in scene.questions.values()]
    for stage, samples in (("words", words), ("captions", captions), ("questions", questions)):
        rng.shuffle(samples)
        write_json(folder / f"{stage}.json", samples)
    asked = [turn(f"<image>\n{q}", a, name) for name, scene in heldout for q, a in scene.questions.values()]
    write_json(folder / "heldout.json", asked)
    return heldout


def write_tokenizer(path: Path) -> None:
    """Byte-level BPE on the demo's words, with ChatML's tokens and the image token as special tokens."""
    rng = random.Random(1)
    texts = ["system user assistant"] * 50
    for _ in range(500):
        scene = random_scene(rng)
        texts += [scene.caption, DESCRIBE, *(f"{q}\n{a}" for q, a in scene.questions.values())]
    tokenizer = train_byte_level_bpe(iter(texts), 400)
    tokenizer.hf.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL_TOKENS])
    tokenizer.save(path)


@dataclass
class Answerer:
    """A saved vision-language model that answers a question about one picture, greedily, as `paratron generate
    --image PICTURE --chat-template chatml` does."""

    model: GPT
    tokenizer: Tokenizer
    settings: ImageSettings
    template: ChatTemplate
    stop_ids: tuple[int, ...]

    @classmethod
    def load(cls, checkpoint: Path) -> Answerer:
        """The model and tokenizer saved in `checkpoint`."""
        info = read_checkpoint(checkpoint)
        tokenizer = tokenizer_from_checkpoint(info)
        assert isinstance(tokenizer, Tokenizer), f"{checkpoint} holds the demo's tokenizer"
        return cls.of(model_from_checkpoint(info), tokenizer, checkpoint)

    @classmethod
    def of(cls, model: GPT, tokenizer: Tokenizer, checkpoint: Path | None = None) -> Answerer:
        config = Config(model=model.config, checkpoint=CheckpointConfig(load=str(checkpoint) if checkpoint else None))
        template = tokenizer_chat_template("chatml", tokenizer)
        return cls(model, tokenizer, image_settings(config, tokenizer), template, chat_stop_ids(template, tokenizer))

    def prompt(self, question: str, pictures: list[Path]) -> tuple[list[int], torch.Tensor]:
        """The question about the picture as a user's turn, ready for the answer: token ids and pixels."""
        text = self.template.render([{"role": "user", "content": f"<image>\n{question}"}], add_generation_prompt=True)
        return encode_prompt(text, pictures, self.tokenizer, self.settings)

    def text(self, new: list[int]) -> str:
        """The answer's text, up to its end of turn."""
        ends = [i for i, token in enumerate(new) if token in self.stop_ids]
        return self.tokenizer.decode(new[: ends[0]] if ends else new).strip()

    def new_tokens(self, prompt_tokens: int, wanted: int) -> int:
        """`wanted` new tokens, or what the model's context leaves after the prompt when that is less."""
        room = self.model.config.max_position_embeddings - prompt_tokens
        if room < 1:
            raise SystemExit(f"a prompt of {prompt_tokens} tokens leaves no room in the model's context")
        return min(wanted, room)

    def answer(self, question: str, picture: Path, new_tokens: int) -> str:
        """One answer, by the library's generation (as `paratron generate` gives it)."""
        ids, images = self.prompt(question, [picture])
        new_tokens = self.new_tokens(len(ids), new_tokens)
        return self.text(generate(self.model, ids, new_tokens, eos_id=self.stop_ids, images=images))

    @torch.no_grad()
    def answers(self, question: str, pictures: list[Path], new_tokens: int) -> list[str]:
        """The answers for many pictures at once: their prompts have the same length, so one batch of greedy steps
        (the same arithmetic as `answer`'s, without the key/value cache) answers them all."""
        rows = [self.prompt(question, [picture]) for picture in pictures]
        ids = torch.tensor([row for row, _ in rows])
        images = torch.cat([pixels for _, pixels in rows])
        new_tokens = self.new_tokens(ids.shape[1], new_tokens)
        for _ in range(new_tokens):
            ids = torch.cat([ids, self.model(ids, images=images)[:, -1].argmax(-1, keepdim=True)], dim=1)
        return [self.text(row[-new_tokens:]) for row in ids.tolist()]


def all_answers(answerer: Answerer, heldout: list[tuple[str, Scene]], folder: Path) -> dict[str, list[str]]:
    """The greedy captions of the held-out pictures and answers to their questions, per kind."""
    pictures = [folder / name for name, _ in heldout]
    return {
        kind: answerer.answers(prompt, pictures, new_tokens(kind))
        for kind, (prompt, _) in heldout[0][1].prompts.items()
    }


def new_tokens(kind: str) -> int:
    return NEW_TOKENS["caption" if kind == "caption" else "answer"]


def accuracy(answers: dict[str, list[str]], heldout: list[tuple[str, Scene]]) -> dict[str, float]:
    """Exact-match accuracy of the answers, per kind of question and overall (the kinds' mean)."""
    scores = {}
    for kind, said in answers.items():
        right = [answer == scene.prompts[kind][1] for answer, (_, scene) in zip(said, heldout, strict=True)]
        scores[kind] = sum(right) / len(right)
    return {**scores, "answers": sum(scores[kind] for kind in KINDS) / len(KINDS)}


@dataclass(frozen=True)
class Stage:
    """One `paratron train --sft` run: what it trains, on which file, for how long."""

    name: str
    trains: str
    data: str
    flags: tuple[str, ...]
    iters: int
    lr: float


STAGES = (
    Stage("stage 0", "the language model alone, on the scenes written out in words", "words.json",
          ("--freeze-vision-model",), 200, 3e-3),
    Stage("stage 1", "the projector alone, on the captions", "captions.json",
          ("--freeze-vision-model", "--freeze-language-model"), 150, 3e-3),
    Stage("stage 2", "the projector and the language model, on the questions", "questions.json",
          ("--freeze-vision-model",), 500, 3e-3),
)  # fmt: skip
"""(Freezing is per run: a stage freezes what its own flags say, whatever the checkpoint's run froze.)"""
PARTS = ("vision encoder", "projector", "language model")
MODEL = {"vision_model": "debug-vit", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
         "max_position_embeddings": 48}  # fmt: skip
SEQ_LENGTH = 48  # tokens: the 16 of a picture, a question and its answer, or a scene in words and its caption


def flags(settings: dict[str, object]) -> list[str]:
    return [part for name, value in settings.items() for part in (f"--{name.replace('_', '-')}", str(value))]


def paratron(*args: str) -> None:
    print("$ paratron " + " ".join(args), flush=True)
    subprocess.run([sys.executable, "-m", "paratron", *args], check=True)


def train(stage: Stage, data: Path, load: Path | None, save: Path, iters: int) -> float:
    """Run the stage (from `load`'s weights, else from random ones); returns its time in seconds."""
    start = time.perf_counter()
    model = ["--load", str(load), "--finetune"] if load else [*flags(MODEL), "--tokenizer-type",
             "HuggingFaceTokenizer", "--tokenizer-model", str(data / "tokenizer.json")]  # fmt: skip
    paratron(
        "train", "--sft", "--data-path", str(data / stage.data), "--chat-template", "chatml", *model, *stage.flags,
        "--seq-length", str(SEQ_LENGTH),
        "--micro-batch-size", "32", "--global-batch-size", "32", "--train-iters", str(iters), "--lr", str(stage.lr),
        "--lr-warmup-iters", str(iters // 10), "--lr-decay-style", "cosine", "--min-lr", f"{stage.lr / 10:g}",
        "--weight-decay", "0",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--eval-iters", "0",
        "--log-interval", str(max(1, iters // 5)),
        "--save", str(save), "--run-dir", str(save.parent / f"{save.name}-run"),
    )  # fmt: skip
    return time.perf_counter() - start


def initial_model(tokenizer: Tokenizer) -> GPT:
    """The weights stage 0 starts from (the same seed and settings give the same weights)."""
    config = build_config({**MODEL, "vocab_size": tokenizer.vocab_size})
    return build_model(config.model, seed=config.training.seed).eval()


def part_of(name: str) -> str:
    """The part of the model a parameter belongs to (PARTS)."""
    if name.startswith("vision.encoder."):
        return "vision encoder"
    return "projector" if name.startswith("vision.projector.") else "language model"


def changed_parts(before: GPT, after: GPT) -> list[str]:
    """The parts of the model whose weights differ: what a stage really trained."""
    old = dict(before.named_parameters())
    changed = {part_of(name) for name, weight in after.named_parameters() if not torch.equal(weight, old[name])}
    return [part for part in PARTS if part in changed]


def report(when: str, answerer: Answerer, heldout: list[tuple[str, Scene]], folder: Path) -> None:
    """The accuracy, and one picture's answers by the library's generation (which must be the batch's)."""
    answers = all_answers(answerer, heldout, folder)
    scores = accuracy(answers, heldout)
    per_kind = ", ".join(f"{kind} {scores[kind]:.0%}" for kind in KINDS)
    print(f"held-out accuracy {when}: answers {scores['answers']:.0%} ({per_kind}), captions {scores['caption']:.0%}")
    name, scene = heldout[-1]  # (the batch's last row: one that would show its pictures out of order)
    for kind, (question, answer) in scene.prompts.items():
        said = answerer.answer(question, folder / name, new_tokens(kind))
        if said != answers[kind][-1]:
            raise RuntimeError(f"{name}: generate answers {said!r} to {question!r}, the batch {answers[kind][-1]!r}")
        print(f"  {name} ({scene.caption}): {question} -> {said!r} (right: {answer!r})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a few pictures and steps: check that it all runs")
    parser.add_argument("--run-dir", type=Path, default=RUN, help=f"where everything goes (default: {RUN})")
    args = parser.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # (our lines and the commands' stay in order)
    data = args.run_dir / "data"
    pictures, heldout_pictures, scale = (40, 4, 0.01) if args.smoke else (600, 60, 1.0)
    heldout = write_data(data, pictures, heldout_pictures)
    write_tokenizer(data / "tokenizer.json")
    chance = sum(1 / n for n in (len(COLOURS), len(SHAPES), len(PLACES))) / len(KINDS)
    print(f"{pictures} training pictures (a caption and {len(KINDS)} questions each) and {heldout_pictures} held-out"
          f" pictures in {data}; chance accuracy {chance:.0%}")  # fmt: skip
    tokenizer = Tokenizer.from_file(str(data / "tokenizer.json"))
    answerer = Answerer.of(initial_model(tokenizer), tokenizer)
    report("before stage 0 (random weights)", answerer, heldout, data)
    load, times = None, []
    for number, stage in enumerate(STAGES):
        print(f"\n{stage.name} trains {stage.trains}")
        save = args.run_dir / f"stage{number}"
        times.append(train(stage, data, load, save, max(2, round(stage.iters * scale))))
        before, answerer, load = answerer.model, Answerer.load(save), save
        print(f"weights {stage.name} changed: {', '.join(changed_parts(before, answerer.model)) or 'none'}")
        report(f"after {stage.name} ({times[-1]:.0f}s)", answerer, heldout, data)
    print("\ntime per stage: " + ", ".join(f"{s.name} {t:.0f}s" for s, t in zip(STAGES, times, strict=True)))


if __name__ == "__main__":
    main()
