"""Two texts from the Python standard library, nothing downloaded: a corpus to train on and a text to fine-tune on.

- `corpus_text()`: the docstrings of 40 standard-library modules (`MODULES`: argparse, json, optparse, pickletools,
  textwrap, unittest, xmlrpc.client, ...): each module's docstring, then those of its public functions, classes
  and methods in source order, read from the `.py` files with `ast` (nothing imported, and `python -OO`, which
  drops `__doc__`, changes nothing), cleaned as `inspect.cleandoc` cleans them, one blank line between two.
  English prose with examples of code: **125,367 characters** (about 18,500 words), 94 distinct characters.
- `zen_text()`: the Zen of Python, the string `this.py` keeps rot13-encoded, decoded as `import this` does (without
  printing it): **857 characters** of aphorisms, not one line of them in the corpus (difflib is left out because
  its example quotes five).

Both use `ALPHABET` (the newline and printable ASCII, 96 characters) and are the same on every machine: the
modules are those whose docstrings are the same, character for character, in CPython 3.10.13, 3.11.2 (Debian's),
3.11.7, 3.12.1 and 3.13.0; many are not (heapq, random, statistics and functools changed between those versions,
plistlib between 3.11.2 and 3.11.7).  `CORPUS_SHA256` and `ZEN_SHA256` pin them; `tests/test_corpus.py` checks
them and rebuilds both under every other Python 3.10+ it finds.  This file imports only the standard library, so
that any Python can run it: `python3.13 pipelab/course/corpus.py` prints the sizes and the hashes.
"""

from __future__ import annotations

import ast
import codecs
import functools
import hashlib
import importlib.util
import string
from pathlib import Path

MODULES = ("argparse", "bz2", "cmd", "codeop", "colorsys", "email.header", "fnmatch", "getopt",
           "graphlib", "hmac", "html.parser", "http.cookies", "json", "json.decoder", "linecache",
           "lzma", "modulefinder", "numbers", "optparse", "pickle", "pickletools", "poplib",
           "pprint", "profile", "py_compile", "pyclbr", "quopri", "rlcompleter", "selectors", "shlex",
           "string", "tabnanny", "textwrap", "tokenize", "tracemalloc", "unittest", "unittest.loader",
           "wsgiref.handlers", "xml.sax.handler", "xmlrpc.client")
ALPHABET = "\n" + "".join(chr(c) for c in range(32, 127))  # the newline and the 95 printable ASCII characters
CORPUS_CHARS, CORPUS_SHA256 = 125_367, "20f4e2d76220f27537fc67fccb73c013c048a92b701f22fbdfb549186e49bd73"
ZEN_CHARS, ZEN_SHA256 = 857, "b0a4de293503af7f9127cce50fbb3f8117e5c2ec8a0ec3cd4897e3995bacf0fd"


def module_source(name: str) -> str:
    """The source of the standard-library module `name` (a package: its `__init__.py`), found without importing
    it."""
    spec = importlib.util.find_spec(name)
    origin = None if spec is None else spec.origin
    if origin is None or not origin.endswith(".py") or not Path(origin).is_file():
        raise FileNotFoundError(f"the standard library's {name!r} has no .py source here (found {origin!r}); the "
                                "corpus is read from the sources a Python installation ships")
    return Path(origin).read_text(encoding="utf-8")


def docstrings(name: str) -> list[str]:
    """Module `name`'s docstrings: the module's, then each public function's, class's and method's, in source
    order (a name starting with "_" is private and left out), each cleaned (`ast.get_docstring(clean=True)`)."""
    tree = ast.parse(module_source(name))
    found = [ast.get_docstring(tree)]
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
            found.append(ast.get_docstring(node))
            if isinstance(node, ast.ClassDef):
                found += [ast.get_docstring(method) for method in node.body
                          if isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef))
                          and not method.name.startswith("_")]
    return [text for text in found if text]


@functools.lru_cache(maxsize=1)
def corpus_text() -> str:
    """The docstrings of `MODULES`, one blank line between two (module docstring)."""
    return _checked("\n\n".join(text for name in MODULES for text in docstrings(name)) + "\n", "the corpus")


@functools.lru_cache(maxsize=1)
def zen_text() -> str:
    """The Zen of Python: `this.s` decoded from rot13 (what `import this` prints)."""
    tree = ast.parse(module_source("this"))
    encoded = next(node.value.value for node in tree.body if isinstance(node, ast.Assign)
                   and any(isinstance(target, ast.Name) and target.id == "s" for target in node.targets))
    return _checked(codecs.decode(encoded, "rot13") + "\n", "the Zen of Python")


def _checked(text: str, what: str) -> str:
    strange = sorted(set(text) - set(ALPHABET))
    if strange:
        raise ValueError(f"{what} holds characters outside the alphabet (the newline and printable ASCII): "
                         f"{strange[:10]}; this Python's sources differ from those the corpus was chosen on")
    return text


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def describe() -> str:
    """One line per text: its characters and SHA-256 (what `python pipelab/course/corpus.py` prints)."""
    return "\n".join(f"{name}: {len(text)} characters, {len(set(text))} distinct, sha256 {sha256(text)}"
                     for name, text in (("corpus", corpus_text()), ("zen", zen_text())))


assert len(ALPHABET) == 96 and set(string.printable) - set(ALPHABET) == set("\t\r\x0b\x0c")

if __name__ == "__main__":
    print(describe())
