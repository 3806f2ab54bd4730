"""Writes tests/cases/token_counts.json: token counts of a fixed corpus computed by
OpenAI's own tokenizer (the `tiktoken` Python package), which the Rust tokenizer is
tested against.

tiktoken normally downloads its vocabularies; nothing can be downloaded here, so the
vocabulary files that tiktoken-rs ships (the same files) are read instead, located with
`cargo metadata`. Run: .venv/bin/python tests/cases/make_token_counts.py
"""

import json
import subprocess
import sys
from pathlib import Path

import tiktoken
import tiktoken.load
import tiktoken_ext.openai_public as openai_public

HERE = Path(__file__).resolve().parent
OUT = HERE / "token_counts.json"
ENCODINGS = ("o200k_base", "cl100k_base")


def tiktoken_rs_assets() -> Path:
    meta = json.loads(subprocess.run(
        ["cargo", "metadata", "--format-version", "1", "--manifest-path", str(HERE.parents[1] / "Cargo.toml")],
        capture_output=True, text=True, check=True).stdout)
    package = next(p for p in meta["packages"] if p["name"] == "tiktoken-rs")
    return Path(package["manifest_path"]).parent / "assets"


def encodings() -> dict:
    assets = tiktoken_rs_assets()
    real_load = tiktoken.load.load_tiktoken_bpe
    # openai_public passes the vocabulary's URL; read the file of the same name instead.
    openai_public.load_tiktoken_bpe = lambda url, expected_hash=None: real_load(str(assets / url.rsplit("/", 1)[-1]), expected_hash)
    return {name: tiktoken.Encoding(**getattr(openai_public, name)()) for name in ENCODINGS}


def corpus() -> list[str]:
    texts = [
        "", "hello world", "Hello, World!", " leading space", "trailing space ", "   many   spaces   ",
        "The quick brown fox jumps over the lazy dog.",
        "Rate limits protect shared capacity; tokens-per-minute limits protect it for LLMs.",
        "don't won't it's we're they've I'm you'll he'd",
        "DON'T WON'T IT'S WE'RE",
        "1234567890 3.14159 -42 1e10 0x1F 1,000,000",
        "def add(a, b):\n    return a + b\n",
        "fn main() {\n\tprintln!(\"{}\", 1 + 2);\n}\n",
        '{"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}',
        "line one\r\nline two\r\n\r\nline four",
        "tabs\tand\tnewlines\n\n\n",
        "你好，世界！这是一个测试。",
        "日本語のテキストとカタカナ、ひらがな。",
        "한국어 문장입니다.",
        "Здравствуй, мир! Это тест.",
        "مرحبا بالعالم",
        "Emoji: 😀🎉👩‍👩‍👧‍👦 🇫🇷 ✔️",
        "Ünïcödé àccénts çà et là, naïve façade",
        "<|endoftext|> is a special token written as text",
        "<|endofprompt|><|fim_prefix|>",
        "https://example.com/path?query=1&other=two#fragment",
        "snake_case camelCase PascalCase kebab-case SCREAMING_CASE",
        "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
        "!!!???...,,,;;;:::---___===+++",
        "Mixed 混合 text with 数字 123 and émojis 🚀.",
    ]
    # Longer, deterministic pieces: repeated prose and a numbers table.
    texts.append(" ".join(["Lorem ipsum dolor sit amet, consectetur adipiscing elit."] * 40))
    texts.append("\n".join(f"{i}\t{i * i}\t{i ** 0.5:.4f}" for i in range(200)))
    texts.append("".join(chr(0x4E00 + (i * 37) % 2000) for i in range(500)))
    return texts


def main() -> None:
    encs = encodings()
    cases = [{"text": text, **{name: len(enc.encode_ordinary(text)) for name, enc in encs.items()}} for text in corpus()]
    data = {
        "about": "Token counts by OpenAI's tiktoken (encode_ordinary: special tokens counted as text). "
                 "Made by tests/cases/make_token_counts.py; do not edit by hand.",
        "tiktoken_version": tiktoken.__version__,
        "cases": cases,
    }
    text = json.dumps(data, ensure_ascii=False, indent=1) + "\n"
    if len(sys.argv) > 1 and sys.argv[1] == "--check":
        sys.exit(0 if OUT.read_text() == text else f"{OUT} is out of date: run {__file__}")
    OUT.write_text(text)
    print(f"wrote {len(cases)} cases to {OUT}")


if __name__ == "__main__":
    main()
