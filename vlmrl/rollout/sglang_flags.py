"""SGLang's ServerArgs fields, read from its source with `ast` (SGLang is never imported).

`sglang_flags.txt` is the committed list of the fields of one SGLang release; this module
writes it by scanning the wheel's `srt/server_args.py` and reads it back so that vlmrl's
launcher checks every flag it passes (a typo fails before any GPU is touched):

    pip download --no-deps sglang==0.5.23 -d /tmp/sg
    python -m vlmrl.rollout.sglang flags --source /tmp/sg/sglang-0.5.23-*.whl \\
        --out vlmrl/rollout/sglang_flags.txt
"""

from __future__ import annotations

import ast
import difflib
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FLAGS_FILE = Path(__file__).with_name("sglang_flags.txt")


@dataclass(frozen=True)
class FlagInfo:
    field: str
    kind: str  # bool | list | value | action | nocli
    flags: tuple[str, ...]  # the CLI spelling first, then aliases
    choices: tuple[str, ...] = ()  # literal choices in SGLang's source (empty: free or dynamic)

    @property
    def cli(self) -> str:
        return self.flags[0]


@dataclass(frozen=True)
class SGLangFlags:
    """SGLang's ServerArgs fields and their command-line flags (one SGLang version)."""

    version: str
    fields: dict[str, FlagInfo]
    extra_flags: frozenset[str] = frozenset()  # flags registered by hand (not fields)
    header: tuple[str, ...] = ()

    def __contains__(self, name: str) -> bool:
        return name in self.fields

    def resolve(self, *candidates: str) -> str:
        """The first candidate that is a field (SGLang renames a few fields across versions,
        e.g. cuda_graph_max_bs -> cuda_graph_max_bs_decode in 0.5.2x)."""
        for c in candidates:
            if c in self.fields:
                return c
        raise UnknownSGLangArg(candidates[0], self)

    def check(self, name: str) -> FlagInfo:
        info = self.fields.get(name)
        if info is None:
            raise UnknownSGLangArg(name, self)
        if info.kind == "nocli":
            raise UnknownSGLangArg(name, self, reason="has no command-line flag")
        return info

    def check_value(self, name: str, value: Any) -> FlagInfo:
        """`check(name)`, and a string value of a field with choices must be one of them."""
        info = self.check(name)
        if info.choices and isinstance(value, str) and value not in info.choices:
            raise ValueError(f"SGLang {self.version}: {name}={value!r} is not one of {list(info.choices)} "
                             f"(see {FLAGS_FILE.name})")
        return info

    def cli_flags(self) -> set[str]:
        out = set(self.extra_flags)
        for info in self.fields.values():
            out.update(info.flags)
        return out


class UnknownSGLangArg(KeyError):
    def __init__(self, name: str, flags: SGLangFlags, reason: str = "is not a ServerArgs field") -> None:
        close = difflib.get_close_matches(name, list(flags.fields), n=5)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        super().__init__(f"SGLang {flags.version}: {name!r} {reason}{hint} (see {FLAGS_FILE.name})")


def load_flags(path: str | Path = FLAGS_FILE) -> SGLangFlags:
    version = "unknown"
    fields: dict[str, FlagInfo] = {}
    extra: set[str] = set()
    header: list[str] = []
    for raw in Path(path).read_text().splitlines():
        line = raw.rstrip()
        if not line:
            continue
        if line.startswith("#"):
            header.append(line)
            if line.startswith("# sglang version:"):
                version = line.split(":", 1)[1].strip()
            continue
        parts = line.split("\t")
        if parts[0] == "@flag":
            extra.add(parts[1])
            continue
        name, kind = parts[0], parts[1]
        flags = tuple(parts[2].split(",")) if len(parts) > 2 and parts[2] else ()
        choices = tuple(parts[3].split(",")) if len(parts) > 3 and parts[3] else ()
        fields[name] = FlagInfo(name, kind, flags, choices)
    return SGLangFlags(version, fields, frozenset(extra), tuple(header))


FLAG_SOURCES = ("srt/server_args.py", "srt/arg_groups/fields/", "srt/arg_groups/choices.py", "version.py")


def _sources(source: str | Path, wanted: tuple[str, ...] = FLAG_SOURCES) -> tuple[dict[str, str], str]:
    """{relative path under sglang/: text} of the files whose path contains one of `wanted`,
    and the version."""
    out: dict[str, str] = {}
    source = Path(source)
    if source.is_file() and zipfile.is_zipfile(source):
        with zipfile.ZipFile(source) as z:
            for n in z.namelist():
                if n.startswith("sglang/") and n.endswith(".py") and any(w in n[len("sglang/"):] for w in wanted):
                    out[n[len("sglang/"):]] = z.read(n).decode()
    else:
        root = source / "sglang" if (source / "sglang").is_dir() else source
        for p in root.rglob("*.py"):
            rel = p.relative_to(root).as_posix()
            if any(w in rel for w in wanted):
                out[rel] = p.read_text()
    return out, _version(source)


def _version(source: Path) -> str:
    """From the wheel's or the installed distribution's METADATA (else sglang/_version.py)."""
    import re

    texts: list[str] = []
    if source.is_file() and zipfile.is_zipfile(source):
        with zipfile.ZipFile(source) as z:
            names = z.namelist()
            texts += [z.read(n).decode() for n in names if n.endswith(".dist-info/METADATA")]
            texts += [z.read(n).decode() for n in names if n == "sglang/_version.py"]
    else:
        base = source.parent if source.name == "sglang" else source
        for p in list(base.glob("sglang-*.dist-info/METADATA")) + [base / "sglang" / "_version.py"]:
            if p.exists():
                texts.append(p.read_text())
    for text in texts:
        m = re.search(r"^Version:\s*(\S+)", text, re.M) or re.search(r"__version__\s*=\s*['\"]([^'\"]+)", text)
        if m:
            return m.group(1)
    return "unknown"


def _kind_of(annotation: ast.expr, arg: dict[str, Any]) -> str:
    if arg.get("no_cli"):
        return "nocli"
    if arg.get("action") is not None:
        return "action"
    text = ast.unparse(annotation)
    if arg.get("type_parser") is not None:
        return "value"
    inner = text.replace("Optional[", "").replace(" ", "")
    if inner.startswith("bool"):
        return "bool"
    if inner.startswith(("List[", "list[")) or arg.get("nargs"):
        return "list"
    return "value"


def _arg_meta(annotation: ast.expr) -> tuple[ast.expr, dict[str, Any]] | None:
    """For `A[T, Arg(...)]` or `A[T, "help"]`: (T, Arg keywords); None for other fields."""
    if not (isinstance(annotation, ast.Subscript) and isinstance(annotation.value, ast.Name)
            and annotation.value.id in ("A", "Annotated")):
        return None
    elts = annotation.slice.elts if isinstance(annotation.slice, ast.Tuple) else [annotation.slice]
    if len(elts) < 2:
        return None
    typ, meta = elts[0], elts[1]
    if isinstance(meta, (ast.Constant, ast.JoinedStr, ast.BinOp)):
        return typ, {}
    if isinstance(meta, ast.Call) and isinstance(meta.func, ast.Name) and meta.func.id == "Arg":
        return typ, _literal_keywords(meta.keywords)
    return None


def _literal_keywords(keywords: list[ast.keyword]) -> dict[str, Any]:
    """A call's keyword arguments: literals evaluated, anything else as source text."""
    kw: dict[str, Any] = {}
    for k in keywords:
        if k.arg is None:
            continue
        try:
            kw[k.arg] = ast.literal_eval(k.value)
        except ValueError:
            kw[k.arg] = ast.unparse(k.value)
    return kw


def _named_lists(files: dict[str, str]) -> dict[str, list[Any]]:
    """Module-level list constants of `srt/arg_groups/choices.py` (ATTENTION_BACKEND_CHOICES
    and the like), which field declarations name instead of spelling out."""
    out: dict[str, list[Any]] = {}
    src = files.get("srt/arg_groups/choices.py")
    if not src:
        return out
    for node in ast.parse(src).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                value = ast.literal_eval(node.value)
            except ValueError:
                continue
            if isinstance(value, (list, tuple)):
                out[node.targets[0].id] = list(value)
    return out


def _choices(kw: dict[str, Any], named: dict[str, list[Any]] | None = None) -> tuple[str, ...]:
    """Literal choices, or a named list (plus a literal list added to it) resolved from
    `named`; empty when the choices are computed at run time."""
    c = kw.get("choices")
    if isinstance(c, str) and named:
        try:
            expr = ast.parse(c, mode="eval").body
        except SyntaxError:
            return ()
        parts = [expr.left, expr.right] if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Add) else [expr]
        c = []
        for part in parts:
            if isinstance(part, ast.Name) and part.id in named:
                c += named[part.id]
            elif isinstance(part, ast.List):
                try:
                    c += ast.literal_eval(part)
                except ValueError:
                    return ()
            else:
                return ()
    if isinstance(c, (list, tuple)) and c and all(isinstance(x, (str, int, float)) and "," not in str(x) for x in c):
        return tuple(str(x) for x in c)
    return ()


def _manual_flags(tree: ast.AST) -> list[tuple[list[str], dict[str, Any]]]:
    """`parser.add_argument("--x", ...)` calls: (flag strings, literal keywords)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            names = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            if names:
                out.append((names, _literal_keywords(node.keywords)))
    return out


def scan_sglang_source(source: str | Path) -> SGLangFlags:
    """Read ServerArgs' fields and flags from an SGLang wheel or package directory, with
    `ast` only. Handles both layouts: fields declared on namespace classes under
    `srt/arg_groups/fields/` (0.5.2x, `A[T, Arg(...)]`, flags derived from field names) and
    the older single `ServerArgs` dataclass whose flags are added by hand in add_cli_args."""
    files, version = _sources(source)
    named = _named_lists(files)
    fields: dict[str, FlagInfo] = {}
    extra: set[str] = set()
    field_files = sorted(k for k in files if "arg_groups/fields/" in k)
    if field_files:
        for rel in field_files:
            tree = ast.parse(files[rel])
            for cls in [n for n in tree.body if isinstance(n, ast.ClassDef)]:
                if not any(isinstance(b, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_NS_PATH"
                                                             for t in b.targets) for b in cls.body):
                    continue
                for b in cls.body:
                    if not (isinstance(b, ast.AnnAssign) and isinstance(b.target, ast.Name)):
                        continue
                    name = b.target.id
                    if name.startswith("_"):
                        continue
                    meta = _arg_meta(b.annotation)
                    if meta is None or meta[1].get("no_cli"):
                        fields[name] = FlagInfo(name, "nocli", ())
                        continue
                    typ, kw = meta
                    cli = kw.get("cli_name") or "--" + name.replace("_", "-")
                    aliases = kw.get("aliases") or []
                    fields[name] = FlagInfo(name, _kind_of(typ, kw), (cli, *aliases), _choices(kw, named))
        # fields registered by hand (dynamic choices); deprecated spellings stay extras
        tree = ast.parse(files.get("srt/server_args.py", ""))
        for names, kw in _manual_flags(tree):
            longs = [n for n in names if n.startswith("--")]
            if not longs:
                continue
            dest = kw.get("dest") or longs[0][2:].replace("-", "_")
            action = str(kw.get("action") or "")
            if "Deprecated" in action or dest not in fields or fields[dest].kind != "nocli":
                extra.update(longs)
                continue
            kind = "bool" if action in ("store_true", "store_false") else "action" if action else (
                "list" if kw.get("nargs") in ("+", "*") else "value")
            fields[dest] = FlagInfo(dest, kind, tuple(longs), _choices(kw))
    else:  # older layout: `class ServerArgs` dataclass + add_argument calls
        tree = ast.parse(files["srt/server_args.py"])
        cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ServerArgs")
        declared = [b.target.id for b in cls.body if isinstance(b, ast.AnnAssign) and isinstance(b.target, ast.Name)]
        by_dest: dict[str, tuple[list[str], dict[str, Any]]] = {}
        for names, kw in _manual_flags(cls):
            longs = [n for n in names if n.startswith("--")]
            if not longs:
                continue
            dest = kw.get("dest") or longs[0][2:].replace("-", "_")
            by_dest.setdefault(dest, (longs, kw))
        for name in declared:
            if name.startswith("_"):
                continue
            if name not in by_dest:
                fields[name] = FlagInfo(name, "nocli", ())
                continue
            longs, kw = by_dest.pop(name)
            action = kw.get("action")
            kind = "bool" if action in ("store_true", "store_false") else "action" if action else (
                "list" if kw.get("nargs") in ("+", "*") else "value")
            fields[name] = FlagInfo(name, kind, tuple(longs), _choices(kw))
        for longs, _ in by_dest.values():
            extra.update(longs)
    extra -= {f for info in fields.values() for f in info.flags}
    return SGLangFlags(version, dict(sorted(fields.items())), frozenset(extra))


def format_flags(flags: SGLangFlags, command: str) -> str:
    lines = [
        "# SGLang ServerArgs fields and their command-line flags, read from SGLang's source with ast.",
        f"# sglang version: {flags.version}",
        f"# generated by: {command}",
        "# format: field<TAB>kind<TAB>--flag[,--alias...][<TAB>choice,...]",
        "#   kind: bool (bare flag) | list (nargs) | value |",
        "#   action (custom argparse action) | nocli (a field without a command-line flag)",
        "# '@flag' lines: flags registered by hand in ServerArgs.add_cli_args (not fields; often deprecated)",
    ]
    for info in flags.fields.values():
        line = f"{info.field}\t{info.kind}\t{','.join(info.flags)}"
        if info.choices:
            line += "\t" + ",".join(info.choices)
        lines.append(line)
    for f in sorted(flags.extra_flags):
        lines.append(f"@flag\t{f}")
    return "\n".join(lines) + "\n"
