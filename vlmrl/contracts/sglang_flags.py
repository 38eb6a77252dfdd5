"""SGLang's ServerArgs fields, read from its source with `ast` (SGLang is never imported).

vlmrl keeps one pair of files per SGLang release it speaks, in `vlmrl/contracts/`:
`sglang-<version>.flags.txt` (the fields of that release's ServerArgs and their command-line
flags, written by this module) and `sglang-<version>.json` (its HTTP contract, written by
`sglang_contract.py`). This module also owns the list of those releases (`known_versions`)
and reads a flag list back (`load_flags`), so that vlmrl's launcher checks every flag it
passes (a typo fails before any GPU is touched). `make sglang-contract SGLANG_VERSION=x`
writes both files of release x; by hand:

    pip download --no-deps sglang==0.5.23 -d /tmp/sg
    python -m vlmrl.rollout.sglang flags --source /tmp/sg/sglang-0.5.23-*.whl
    (written to vlmrl/contracts/sglang-0.5.23.flags.txt, the version read from the wheel)
"""

from __future__ import annotations

import ast
import difflib
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONTRACTS_DIR = Path(__file__).parent
_CONTRACT_SUFFIX = ".json"
_FLAGS_SUFFIX = ".flags.txt"


class UnknownSGLangVersion(ValueError):
    """vlmrl has no contract for this SGLang release."""

    def __init__(self, version: str, known: tuple[str, ...]) -> None:
        super().__init__(
            f"vlmrl has no contract for SGLang {version} (it has contracts for {', '.join(known) or 'none'}, in "
            f"vlmrl/contracts); generate one with `make sglang-contract SGLANG_VERSION={version}`")
        self.version = version
        self.known = known


def _version_key(version: str) -> tuple:
    """Release order: numeric parts as numbers (0.5.9 < 0.5.17), a pre-release suffix
    (0.5.24rc1) before the release itself."""
    parts = re.split(r"[.+-]", version)
    key: list[tuple[int, int, str]] = []
    for p in parts:
        m = re.fullmatch(r"(\d+)(.*)", p)
        if m:
            key.append((int(m.group(1)), 0 if m.group(2) else 1, m.group(2)))
        else:
            key.append((-1, 0, p))
    return tuple(key)


def known_versions() -> tuple[str, ...]:
    """The SGLang releases vlmrl has a contract and a flag list for, oldest first."""
    found = {p.name[len("sglang-"):-len(_CONTRACT_SUFFIX)] for p in CONTRACTS_DIR.glob("sglang-*" + _CONTRACT_SUFFIX)}
    both = [v for v in found if (CONTRACTS_DIR / f"sglang-{v}{_FLAGS_SUFFIX}").is_file()]
    return tuple(sorted(both, key=_version_key))


def resolve_version(version: str | None = None) -> str:
    """`version` when vlmrl has its contract, the newest known when None; else
    UnknownSGLangVersion naming the known ones and the command that adds one."""
    known = known_versions()
    if version is None:
        if not known:
            raise UnknownSGLangVersion("(any)", known)
        return known[-1]
    version = str(version)
    if version not in known:
        raise UnknownSGLangVersion(version, known)
    return version


def contract_file(version: str) -> Path:
    """Where the contract of SGLang `version` is written (it may not exist yet)."""
    return CONTRACTS_DIR / f"sglang-{version}{_CONTRACT_SUFFIX}"


def flags_file(version: str) -> Path:
    """Where the flag list of SGLang `version` is written (it may not exist yet)."""
    return CONTRACTS_DIR / f"sglang-{version}{_FLAGS_SUFFIX}"


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
            flag = "--" + name.replace("_", "-")
            reason = (f"has no command-line flag of its own ({flag} is registered as deprecated)"
                      if flag in self.extra_flags else "has no command-line flag")
            raise UnknownSGLangArg(name, self, reason=reason)
        return info

    def check_value(self, name: str, value: Any) -> FlagInfo:
        """`check(name)`, and a string value of a field with choices must be one of them."""
        info = self.check(name)
        if info.choices and isinstance(value, str) and value not in info.choices:
            raise ValueError(f"SGLang {self.version}: {name}={value!r} is not one of {list(info.choices)} "
                             f"(see {flags_file(self.version).name})")
        return info

    def cli_flags(self) -> set[str]:
        out = set(self.extra_flags)
        for info in self.fields.values():
            out.update(info.flags)
        return out


class UnknownSGLangArg(KeyError):
    def __init__(self, name: str, flags: SGLangFlags, reason: str = "is not a ServerArgs field") -> None:
        close = difflib.get_close_matches(name, [f for f, i in flags.fields.items() if f != name and i.kind != "nocli"],
                                          n=5)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        super().__init__(f"SGLang {flags.version}: {name!r} {reason}{hint} (see {flags_file(flags.version).name})")


def load_flags(version: str | Path | None = None) -> SGLangFlags:
    """The flag list of SGLang `version` (None: the newest vlmrl knows; an unknown one raises
    UnknownSGLangVersion). A Path (or a string naming a `.txt` file) reads that file instead."""
    if isinstance(version, Path) or (isinstance(version, str) and version.endswith(".txt")):
        path = Path(version)
    else:
        path = flags_file(resolve_version(version))
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
    """For `A[T, ...]` / `Annotated[T, ...]`: (T, Arg keywords) from the first `Arg(...)` or help
    string among the metadata (other markers, e.g. a namespace, are passed over); None for a
    field with neither (SGLang gives it no flag of its own)."""
    if not (isinstance(annotation, ast.Subscript) and isinstance(annotation.value, ast.Name)
            and annotation.value.id in ("A", "Annotated")):
        return None
    elts = annotation.slice.elts if isinstance(annotation.slice, ast.Tuple) else [annotation.slice]
    typ = elts[0]
    for meta in elts[1:]:
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
    """Module-level list (or set) constants that field declarations name instead of spelling
    out (ATTENTION_BACKEND_CHOICES and the like): those of `srt/server_args.py` (where the
    single-class layout keeps them), overridden by `srt/arg_groups/choices.py`'s. A set is
    recorded sorted (it has no order of its own)."""
    out: dict[str, list[Any]] = {}
    for rel in ("srt/server_args.py", "srt/arg_groups/choices.py"):
        src = files.get(rel)
        if not src:
            continue
        for node in ast.parse(src).body:
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                try:
                    value = ast.literal_eval(node.value)
                except ValueError:
                    continue
                if isinstance(value, (list, tuple)):
                    out[node.targets[0].id] = list(value)
                elif isinstance(value, (set, frozenset)):
                    out[node.targets[0].id] = sorted(value, key=str)
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


def _annotated_fields(classes: list[ast.ClassDef], named: dict[str, list[Any]]) -> dict[str, FlagInfo]:
    """Fields declared `name: A[T, Arg(...) | "help", ...] = default` on `classes`: the flag is
    `--name-with-dashes` (or the Arg's cli_name) plus its aliases; a field with neither an Arg
    nor a help string, or with no_cli, has no flag of its own ("nocli")."""
    fields: dict[str, FlagInfo] = {}
    for cls in classes:
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
    return fields


def scan_sglang_source(source: str | Path) -> SGLangFlags:
    """Read ServerArgs' fields and flags from an SGLang wheel or package directory, with
    `ast` only. Handles three layouts: fields declared `A[T, Arg(...)]` on namespace classes
    under `srt/arg_groups/fields/` (0.5.2x); the same annotations on the single `ServerArgs`
    dataclass of `srt/server_args.py` (0.5.17); and the older `ServerArgs` whose flags are all
    added by hand in add_cli_args. In the first two, flags are derived from field names, and
    the few `add_argument` calls register fields with dynamic choices and deprecated spellings."""
    files, version = _sources(source)
    if "srt/server_args.py" not in files:
        raise ValueError(f"no sglang/srt/server_args.py under {source}")
    named = _named_lists(files)
    fields: dict[str, FlagInfo] = {}
    extra: set[str] = set()
    server_args = ast.parse(files["srt/server_args.py"])
    field_files = sorted(k for k in files if "arg_groups/fields/" in k)
    if field_files:
        classes = [cls for rel in field_files for cls in ast.parse(files[rel]).body
                   if isinstance(cls, ast.ClassDef) and any(
                       isinstance(b, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_NS_PATH"
                                                         for t in b.targets) for b in cls.body)]
    else:
        classes = [n for n in server_args.body if isinstance(n, ast.ClassDef) and n.name == "ServerArgs"]
        if not classes:
            raise ValueError(f"no class ServerArgs in sglang/srt/server_args.py under {source}")
    annotated = any(isinstance(b, ast.AnnAssign) and _arg_meta(b.annotation) is not None
                    for cls in classes for b in cls.body)
    if annotated:
        fields = _annotated_fields(classes, named)
        # fields registered by hand (dynamic choices); deprecated spellings stay extras
        for names, kw in _manual_flags(server_args):
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
            fields[dest] = FlagInfo(dest, kind, tuple(longs), _choices(kw, named))
    else:  # oldest layout: `class ServerArgs` dataclass + add_argument calls
        cls = classes[0]
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
            fields[name] = FlagInfo(name, kind, tuple(longs), _choices(kw, named))
        for longs, _ in by_dest.values():
            extra.update(longs)
    if not any(info.kind != "nocli" for info in fields.values()):
        raise ValueError(f"no ServerArgs field with a command-line flag found under {source}; "
                         "SGLang's layout changed, update vlmrl/contracts/sglang_flags.py")
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
