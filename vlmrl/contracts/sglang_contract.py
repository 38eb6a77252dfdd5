"""SGLang's native HTTP contract, read from its source with `ast` (SGLang is never imported).

vlmrl speaks each SGLang release from that release's contract: `vlmrl/contracts/`
holds one pair of files per release, `sglang-<version>.json` (written here) and
`sglang-<version>.flags.txt` (its ServerArgs flags, `sglang_flags.py`). The tests hold vlmrl's
client, embedded server and launcher against every contract (tests/unit/test_sglang_contract.py).
`make sglang-contract SGLANG_VERSION=x` writes release x's pair (default: the newest there);
this file alone, by hand:

    pip download --no-deps sglang==0.5.23 -d /tmp/sg
    python -m vlmrl.rollout.sglang contract --source /tmp/sg/sglang-0.5.23-*.whl
    (written to vlmrl/contracts/sglang-0.5.23.json, the version read from the wheel)

The API: `known_versions()` (oldest first), `load_contract(version)` (None: the newest;
an unknown release raises `UnknownSGLangVersion`, a ValueError naming the known ones and the
make command that adds one), `protocol(version)` (an `SGLangProtocol`: what the release
offers, derived from its contract alone) and `verify_sampling_params(params, version=...)`
(SGLang's own verdict on one request's sampling parameters, from the recorded checks).

What the scan reads, and how far to trust each piece (paths are under the `sglang/`
package; a piece that is not found raises `ContractScanError`, it never comes back empty):

- `endpoints` {path: sorted methods}, every route of `srt/entrypoints/http_server.py`:
  decorators `@app.get/post/put/delete/patch/head/options/websocket(path)` and
  `@app.api_route(path, methods=[...])` on functions anywhere in the module (inside `if`
  blocks too), `app.add_api_route(...)` calls, and the routes of the `APIRouter`s the module
  mounts with `app.include_router(...)` (followed through `from sglang.x import router`).
  A path written `os.environ.get("VAR", "/default")` is recorded under its default; a path
  that is not a literal lands in `unresolved_routes`. Conditional routes (an `if` on an
  environment variable) are recorded as if registered. Robust: FastAPI routing is declarative.
- `endpoint_requests` {path: struct} (keyed "METHOD path" where a path's methods take
  different structs): the class annotating a parameter of the route's handler (`obj: GenerateReqInput`, `obj: Annotated[InitWeightsUpdateGroupReqInput, Body()]`),
  when it is a class of the sglang package; `request_structs` holds the fields of those
  classes (class-level annotations, fields of bases in the package first, each written
  `"annotation = default"` as source text, or the bare annotation when required: see
  `parse_field`) and `response_structs` the matching `...ReqOutput` classes.
  Robust for dataclasses, msgspec Structs and pydantic models; fields made at run time are
  not seen. Handlers that read `request.json()` by hand have no entry.
- `sampling_params.fields`: the arguments of `SamplingParams.__init__` in
  `srt/sampling/sampling_params.py`, or its class-level fields when it has no `__init__`
  (a msgspec Struct in 0.5.17 and 0.5.23; its internal fields are init arguments too).
- `sampling_params.verify`: the checks of `SamplingParams.verify` (a method of the Struct in
  both releases). `rules`, in source order: one per `raise ValueError(...)`, with
  `condition` (the test of the innermost `if` around it, source text), `guards` (the enclosing
  `{"if": test}` / `{"for": name, "in": iterable}` chain, outermost first; an `else` branch
  is written `not (test)`), `message` (the message as written: an f-string's text with each
  `{expression}` as in the source), `locals` (assignments of verify the rule reads, in
  order), `parameters` (the `self.<field>`s it reads) and `where`. `post_init`: the steps of
  `__post_init__`, which runs first (None means the default, temperature 0 becomes greedy
  top_k 1, top_k -1 becomes "all"), nested as written; `constants`: the module constants
  they read. Rules and steps are recorded in a small expression language (see
  `_expressible`): a rule written outside it fails the scan; a `__post_init__` statement
  outside it is listed under `post_init.skipped` and not replayed. Not seen: checks made by
  helper functions verify calls (listed in `unfollowed_calls`), by `normalize()` (it only
  refuses features that need a tokenizer when the server runs without one), and type
  checks of the JSON schema in front of /generate. Trust: exact for what is recorded (the
  source text itself); complete only as far as those gaps go.
- `generate.meta_info_keys`: LEXICAL, the least robust piece. The keys written into a
  variable named `meta_info` in `srt/managers/tokenizer_manager.py`: dict literals assigned
  to it, `meta_info["k"] = ...`, `meta_info.update({...})` / `.update(k=...)`,
  `.setdefault("k", ...)`, `out["meta_info"]["k"] = ...`, plus the same writes inside the
  package functions that receive it as an argument (followed one call deep, e.g.
  `add_weight_versions_to_meta_info`); `generate.meta_info_sources` lists where they were
  found. Keys merged from dicts built elsewhere (`meta_info.update(time_stats....())` with
  --enable-metrics, customized_info, speculative-decoding metrics written under another
  name) are NOT seen, so the list is a lower bound of what SGLang may send: a key vlmrl
  reads that is missing here is either a real break or a key SGLang now writes through one
  of those indirect paths; check the source before trusting either. The scan fails if no
  `meta_info` dict is built or it lacks "finish_reason". It covers every reply the
  tokenizer manager builds (generate and embedding alike). `generate.response_keys`: the
  keys of the reply dicts holding "meta_info" (and keys later set on them);
  `generate.finish_reasons`: the dicts `to_json` returns in the `FINISH_*` classes of
  `srt/managers/schedule_batch.py`.
- `memory`: the `GPU_MEMORY_TYPE_*` constants of `srt/constants.py` (`tags`) and
  `GPU_MEMORY_ALL_TYPES` (`all_types`); `no_tags`: for `release_memory_occupation` and
  `resume_memory_occupation`, where a missing or empty `tags` is replaced
  (`if tags is None ...: tags = X`) and what X holds; `release_requires_idle`: the
  `assert <condition>, "message"` of the release that defaults its tags (SGLang's scheduler
  dies on it when a request is running). Robust: a literal assertion.
- `api_schema` (SGLang 0.5.2x; null when the wheel has no `api/v1/api_types.py`, as in
  0.5.17): the generated JSON schema `/generate` bodies are checked against before the
  dataclass sees them: each struct's fields and whether it rejects unknown keys (its
  `decode_<Name>` raises `_unknown_field`) or ignores them. `SamplingParams` rejects them: an
  unknown sampling key is an HTTP 400, not silently dropped.
- `loads`: `endpoint` / `server_info` (whether /v1/loads and /server_info are routes);
  `core_keys`: the fields of `LoadSnapshot` in `srt/managers/load_snapshot.py` less those
  named in its `_SECTION_FIELDS` literal (what /v1/loads?include=core answers per
  data-parallel rank), `sections` those; `reply_keys`: the keys of the dict literal the
  /v1/loads handler returns; `server_info_keys` / `server_info_version`: the string keys of
  the dict literals /server_info's handler returns (merged `**dicts` are not seen) and
  whether "version" is one. Robust: declarative fields and literal replies.
- `weight_update`: `session` (both /begin_weight_update and /end_weight_update are routes)
  and `session_required`: the routes of the methods that, in the class defining
  begin_weight_update and end_weight_update, return early when the attribute begin sets is
  None (the calls the release refuses outside a session); `where` names the class.
  Moderately robust: it relies on that `if self.<attr> is None: return ...` shape.
- `weight_loader`: what vlmrl's loader inside the server relies on. `custom_loader`: the
  `update_weights_from_tensor` that calls a loader named in `custom_weight_loaders`
  (`load_format` in that list, imported with `dynamic_import`) with two arguments, as written;
  `unquantized_moe`: `UnquantizedFusedMoEMethod`'s `self.X` attributes set in `__init__` and the
  parameters `create_weights` registers by literal name; `qwen3_5_fused_experts`: the
  (parameter, checkpoint name) pairs of the `fused_expert_params_mapping` lists in
  `srt/models/qwen3_5.py`. Robust for what is recorded; a post-processing step that rewrites the
  experts' layout under an attribute set elsewhere is not seen (tests/unit/test_sglang_contract.py
  makes the loader classify every attribute recorded here).
- `model_configs[model_type]` for `qwen3_5` and `qwen3_5_moe`: the class under
  `srt/configs/` declaring that `model_type` with a `sub_configs` dict, and for its
  `text_config` / `vision_config` classes (`text`, `vision`): `class`, `chain` (the class and
  its bases inside the package), `bases_outside` (e.g. transformers' PretrainedConfig, not
  read), `defaults` {init parameter: literal value, or {"source": text} when not a literal;
  a subclass's default wins; `kwargs.pop/get("k", default)` counts as parameter k} and
  `required`: attributes the chain's methods and properties read as `self.X` that no
  `__init__` of the chain assigns and no class of it defines (e.g. `full_attention_interval`:
  a checkpoint must carry it). Attributes PretrainedConfig itself sets would be listed too
  (none are read in 0.5.17 / 0.5.23). Robust for plain config classes.

The JSON is written with sorted keys, so regenerating from the same wheel gives no diff.
"""

from __future__ import annotations

import ast
import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .sglang_flags import (
    UnknownSGLangVersion,
    _sources,
    contract_file,
    known_versions,
    resolve_version,
)

__all__ = ["ContractScanError", "SGLangProtocol", "UnknownSGLangVersion", "format_contract", "known_versions",
           "load_contract", "parse_field", "protocol", "scan_contract", "verify_sampling_params"]

# the files the scan may read (paths under sglang/ containing one of these)
CONTRACT_SOURCES = ("srt/", "api/", "version.py")

HTTP_SERVER = "srt/entrypoints/http_server.py"
TOKENIZER_MANAGER = "srt/managers/tokenizer_manager.py"
SAMPLING_PARAMS = "srt/sampling/sampling_params.py"
CONSTANTS = "srt/constants.py"
SCHEDULE_BATCH = "srt/managers/schedule_batch.py"
API_TYPES = "api/v1/api_types.py"
LOAD_SNAPSHOT = "srt/managers/load_snapshot.py"
CONFIGS_DIR = "srt/configs/"
QWEN3_5_MODEL = "srt/models/qwen3_5.py"
LOADS_PATH = "/v1/loads"
SERVER_INFO_PATH = "/server_info"
SESSION_PATHS = ("/begin_weight_update", "/end_weight_update")
# SGLang's config classes recorded under model_configs (checkpoints are checked against them)
MODEL_CONFIG_TYPES = ("qwen3_5", "qwen3_5_moe")

_VERBS = ("get", "post", "put", "delete", "patch", "head", "options")
_NOT_STRUCTS = {"Request", "Response", "WebSocket", "UploadFile", "BackgroundTasks", "str", "int", "float", "bool",
                "bytes", "dict", "list", "Any", "Optional", "Dict", "List"}
_MEMORY_CALLS = ("release_memory_occupation", "resume_memory_occupation")


class ContractScanError(RuntimeError):
    """A piece of the contract could not be found in the SGLang source (the layout changed)."""


# --------------------------------------------------------------------------- source access
class _Package:
    """The scanned files, parsed lazily, with module-path and import resolution."""

    def __init__(self, files: dict[str, str]) -> None:
        self.files = files
        self._trees: dict[str, ast.Module] = {}

    def tree(self, rel: str, what: str) -> ast.Module:
        if rel not in self.files:
            raise ContractScanError(f"{what}: sglang/{rel} is not in the source")
        if rel not in self._trees:
            self._trees[rel] = ast.parse(self.files[rel], filename=rel)
        return self._trees[rel]

    def module_file(self, dotted: str) -> str | None:
        if not dotted.startswith("sglang."):
            return None
        base = dotted[len("sglang."):].replace(".", "/")
        for rel in (base + ".py", base + "/__init__.py"):
            if rel in self.files:
                return rel
        return None

    def imports(self, rel: str) -> dict[str, tuple[str, str]]:
        """local name -> (file, name there) for `from sglang.x import y [as z]` anywhere in rel."""
        out: dict[str, tuple[str, str]] = {}
        pkg = rel.rsplit("/", 1)[0].split("/") if "/" in rel else []
        for node in ast.walk(self.tree(rel, "imports")):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:  # relative import
                parts = pkg[: len(pkg) - (node.level - 1)] if node.level > 1 else pkg
                dotted = ".".join(["sglang", *parts, *([node.module] if node.module else [])])
            else:
                dotted = node.module or ""
            target = self.module_file(dotted)
            if target is None:
                continue
            for a in node.names:
                out[a.asname or a.name] = (target, a.name)
        return out

    def top(self, rel: str, name: str, kind: type | tuple[type, ...]) -> Any:
        for node in self.tree(rel, name).body:
            if isinstance(node, kind) and getattr(node, "name", None) == name:
                return node
        return None

    def resolve_class(self, rel: str, name: str) -> tuple[str, ast.ClassDef] | None:
        """The class `name` as seen from module rel: defined there or imported from sglang."""
        node = self.top(rel, name, ast.ClassDef)
        if node is not None:
            return rel, node
        target = self.imports(rel).get(name)
        if target is not None:
            node = self.top(target[0], target[1], ast.ClassDef)
            if node is not None:
                return target[0], node
        return None


def _where(rel: str, node: ast.AST) -> str:
    return f"{rel}:{getattr(node, 'lineno', 0)}"


def _str(node: ast.AST | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


# --------------------------------------------------------------------------- routes
def _route_path(node: ast.AST | None) -> str | None:
    """A literal path, or the default of `os.environ.get("VAR", "/x")` / `os.getenv(...)`."""
    if (s := _str(node)) is not None:
        return s
    if isinstance(node, ast.Call) and _name(node.func) in ("get", "getenv") and len(node.args) == 2:
        return _str(node.args[1])
    return None


def _route_of(call: ast.Call, owners: set[str]) -> tuple[ast.AST | None, list[str]] | None:
    """(path expression, methods) for `owner.<verb>(path, ...)` / `owner.api_route(...)`."""
    if not (isinstance(call.func, ast.Attribute) and _name(call.func.value) in owners):
        return None
    attr = call.func.attr
    kw = {k.arg: k.value for k in call.keywords if k.arg}
    path = call.args[0] if call.args else kw.get("path")
    if attr in _VERBS:
        return path, [attr.upper()]
    if attr == "websocket":
        return path, ["WEBSOCKET"]
    if attr in ("api_route", "add_api_route"):
        methods = kw.get("methods")
        try:
            values = ast.literal_eval(methods) if methods is not None else ["GET"]
        except ValueError:
            values = []
        return path, sorted(str(m).upper() for m in values)
    return None


def _scan_routes(pkg: _Package, rel: str, owners: set[str], prefix: str, out: dict[str, Any]) -> None:
    tree = pkg.tree(rel, "routes")
    functions = {n.name: n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    found: list[tuple[ast.AST | None, list[str], ast.AST, ast.AST]] = []  # (path, methods, handler, site)
    for fn in functions.values():
        for dec in fn.decorator_list:
            if isinstance(dec, ast.Call) and (r := _route_of(dec, owners)) is not None:
                found.append((r[0], r[1], fn, dec))
    for node in ast.walk(tree):  # owner.add_api_route(path, handler, methods=[...])
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_api_route"
                and (r := _route_of(node, owners)) is not None):
            handler = node.args[1] if len(node.args) > 1 else next(
                (k.value for k in node.keywords if k.arg == "endpoint"), None)
            fn = functions.get(_name(handler) or "")
            if fn is not None:
                found.append((r[0], r[1], fn, node))
    for path_expr, methods, fn, site in found:
        path = _route_path(path_expr)
        label = f"{_where(rel, site)} {fn.name}"
        if path is None:
            out["unresolved_routes"].append(label)
            continue
        path = prefix + path
        out["endpoints"].setdefault(path, set()).update(methods)
        out["endpoint_handlers"].setdefault(path, set()).add(label)
        out["_fns"].setdefault(path, (rel, fn))
        struct = _handler_struct(pkg, rel, fn)
        for m in methods:
            out["_requests"][(path, m)] = None if struct is None else struct[1].name
        if struct is not None:
            out["_structs"][struct[1].name] = struct
    # routers this module mounts: app.include_router(router [, prefix="/x"])
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "include_router" and _name(node.func.value) in owners and node.args):
            continue
        local = _name(node.args[0])
        target = pkg.imports(rel).get(local or "")
        sub_prefix = _str(next((k.value for k in node.keywords if k.arg == "prefix"), None)) or ""
        if target is None:
            out["unresolved_routes"].append(f"{_where(rel, node)} include_router({local})")
            continue
        _scan_routes(pkg, target[0], {target[1]}, prefix + sub_prefix, out)


def _app_names(tree: ast.Module) -> set[str]:
    """Names bound to `FastAPI(...)` in a module."""
    out = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                and _name(node.value.func) == "FastAPI"):
            out.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return out


def _handler_struct(pkg: _Package, rel: str, fn: ast.AST) -> tuple[str, ast.ClassDef] | None:
    """The package class annotating one of the handler's parameters."""
    args = fn.args  # type: ignore[attr-defined]
    for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]:
        ann = a.annotation
        if isinstance(ann, ast.Subscript) and _name(ann.value) == "Annotated":
            ann = ann.slice.elts[0] if isinstance(ann.slice, ast.Tuple) else ann.slice
        name = _name(ann) if ann is not None else None
        if name and name not in _NOT_STRUCTS and (found := pkg.resolve_class(rel, name)) is not None:
            return found
    return None


# --------------------------------------------------------------------------- structs
def _default(value: ast.expr | None) -> tuple[bool, str | None]:
    """(required, default as source text) of a field's assigned value."""
    if value is None:
        return True, None
    if isinstance(value, ast.Call) and _name(value.func) in ("field", "Field"):
        kw = {k.arg: k.value for k in value.keywords if k.arg}
        if "default" in kw:
            return False, ast.unparse(kw["default"])
        if "default_factory" in kw:
            return False, ast.unparse(kw["default_factory"]) + "()"
        if value.args and not (isinstance(value.args[0], ast.Constant) and value.args[0].value is Ellipsis):
            return False, ast.unparse(value.args[0])
        return True, None
    return False, ast.unparse(value)


def _field(annotation: ast.expr, value: ast.expr | None) -> str:
    """`"annotation = default"`, or the bare annotation for a required field (see parse_field)."""
    required, default = _default(value)
    return ast.unparse(annotation) if required else f"{ast.unparse(annotation)} = {default}"


def parse_field(spec: str) -> tuple[str, bool, str | None]:
    """(annotation, required, default source) of a field as the contract writes it."""
    annotation, sep, default = spec.partition(" = ")
    return annotation, not sep, default if sep else None


def _class_fields(pkg: _Package, rel: str, cls: ast.ClassDef, depth: int = 0) -> dict[str, str]:
    """Class-level annotated fields, those of the package bases first (ClassVar skipped)."""
    fields: dict[str, str] = {}
    if depth < 10:
        for base in cls.bases:
            name = _name(base)
            if name and (found := pkg.resolve_class(rel, name)) is not None and found[1] is not cls:
                fields.update(_class_fields(pkg, found[0], found[1], depth + 1))
    for stmt in cls.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            if ast.unparse(stmt.annotation).startswith(("ClassVar", "typing.ClassVar")):
                continue
            fields[stmt.target.id] = _field(stmt.annotation, stmt.value)
    return fields


def _init_args(fn: ast.FunctionDef) -> dict[str, str]:
    a = fn.args
    positional = [*a.posonlyargs, *a.args][1:]  # without self
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    return {arg.arg: _field(arg.annotation or ast.Name("Any"), d)
            for arg, d in [*zip(positional, defaults), *zip(a.kwonlyargs, a.kw_defaults)]}


def _sampling_params(pkg: _Package) -> dict[str, Any]:
    cls = pkg.top(SAMPLING_PARAMS, "SamplingParams", ast.ClassDef) if SAMPLING_PARAMS in pkg.files else None
    if cls is None:
        raise ContractScanError(f"sampling params: no class SamplingParams in sglang/{SAMPLING_PARAMS}")
    init = next((b for b in cls.body if isinstance(b, ast.FunctionDef) and b.name == "__init__"), None)
    args = _init_args(init) if init is not None else _class_fields(pkg, SAMPLING_PARAMS, cls)
    if not args:
        raise ContractScanError(f"sampling params: SamplingParams in sglang/{SAMPLING_PARAMS} has no fields")
    return {"fields": args, "verify": _sampling_verify(pkg, cls, args)}


# --------------------------------------------------------------------------- expressions
# The small expression language the verify rules are recorded in and evaluated by
# `verify_sampling_params`: literals, names, `self.<field>`, arithmetic, comparisons, boolean
# logic, conditional expressions, comprehensions, subscripts, f-strings, `math.<name>` and
# the builtins below. The scan refuses a rule written with anything else.
_BUILTINS: dict[str, Any] = {
    "isinstance": isinstance, "int": int, "float": float, "str": str, "bool": bool, "len": len, "sum": sum,
    "min": min, "max": max, "abs": abs, "type": type, "list": list, "set": set, "tuple": tuple, "dict": dict,
    "sorted": sorted, "any": any, "all": all,
}
_MATH = ("isfinite", "isnan", "isinf", "inf", "nan")
_BINOPS: dict[type, Any] = {
    ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b, ast.FloorDiv: lambda a, b: a // b, ast.Mod: lambda a, b: a % b,
    ast.Pow: lambda a, b: a ** b, ast.LShift: lambda a, b: a << b, ast.RShift: lambda a, b: a >> b,
    ast.BitOr: lambda a, b: a | b, ast.BitAnd: lambda a, b: a & b, ast.BitXor: lambda a, b: a ^ b,
}
_CMPOPS: dict[type, Any] = {
    ast.Eq: lambda a, b: a == b, ast.NotEq: lambda a, b: a != b, ast.Lt: lambda a, b: a < b,
    ast.LtE: lambda a, b: a <= b, ast.Gt: lambda a, b: a > b, ast.GtE: lambda a, b: a >= b,
    ast.Is: lambda a, b: a is b, ast.IsNot: lambda a, b: a is not b, ast.In: lambda a, b: a in b,
    ast.NotIn: lambda a, b: a not in b,
}
_UNARY: dict[type, Any] = {ast.Not: lambda a: not a, ast.USub: lambda a: -a, ast.UAdd: lambda a: +a,
                           ast.Invert: lambda a: ~a}
_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.GeneratorExp)


class _NotExpressible(Exception):
    """A construct outside the expression language (the message says which)."""


def _expr(text: str) -> ast.expr:
    return ast.parse(text, mode="eval").body


def _free_names(node: ast.AST) -> set[str]:
    """Names an expression reads that it does not bind itself (comprehension targets)."""
    bound: set[str] = set()
    for n in ast.walk(node):
        if isinstance(n, ast.comprehension):
            bound |= {t.id for t in ast.walk(n.target) if isinstance(t, ast.Name)}
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)} - bound


def _expressible(node: ast.AST, names: set[str]) -> None:
    """Raise _NotExpressible unless `node` is in the expression language, reading only `names`
    (plus the builtins, `math` and its own comprehension targets)."""
    bound = set(names) | set(_BUILTINS) | {"math"}
    for n in ast.walk(node):
        if isinstance(n, ast.comprehension):
            if not isinstance(n.target, ast.Name) or n.is_async:
                raise _NotExpressible(f"comprehension target {ast.unparse(n.target)}")
            bound.add(n.target.id)
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            if n.id not in bound:
                raise _NotExpressible(f"name {n.id!r}")
        elif isinstance(n, ast.Attribute):
            base = _name(n.value) if isinstance(n.value, ast.Name) else None
            if not (base == "self" or (base == "math" and n.attr in _MATH) or n.attr == "__name__"):
                raise _NotExpressible(f"attribute {ast.unparse(n)}")
        elif isinstance(n, ast.Call):
            callee = n.func
            ok = (isinstance(callee, ast.Name) and callee.id in _BUILTINS) or (
                isinstance(callee, ast.Attribute) and _name(callee.value) == "math" and callee.attr in _MATH)
            if not ok or any(isinstance(a, ast.Starred) for a in n.args) or any(k.arg is None for k in n.keywords):
                raise _NotExpressible(f"call {ast.unparse(n)}")
        elif isinstance(n, ast.BinOp) and type(n.op) not in _BINOPS:
            raise _NotExpressible(f"operator in {ast.unparse(n)}")
        elif isinstance(n, (ast.Lambda, ast.NamedExpr, ast.DictComp, ast.Await, ast.Yield, ast.YieldFrom,
                            ast.Starred)):
            raise _NotExpressible(f"{type(n).__name__} {ast.unparse(n)}")


def _evaluate(node: ast.AST, env: dict[str, Any]) -> Any:
    """Evaluate an expression of the expression language (checked by `_expressible`) in env."""
    ev = _evaluate
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        if node.id in env:
            return env[node.id]
        if node.id in _BUILTINS:
            return _BUILTINS[node.id]
        raise NameError(node.id)
    if isinstance(node, ast.Attribute):
        if isinstance(node.value, ast.Name) and node.value.id == "math" and "math" not in env:
            return getattr(math, node.attr)
        return getattr(ev(node.value, env), node.attr)
    if isinstance(node, ast.BoolOp):
        value: Any = None
        for v in node.values:
            value = ev(v, env)
            if isinstance(node.op, ast.And) and not value:
                return value
            if isinstance(node.op, ast.Or) and value:
                return value
        return value
    if isinstance(node, ast.UnaryOp):
        return _UNARY[type(node.op)](ev(node.operand, env))
    if isinstance(node, ast.BinOp):
        return _BINOPS[type(node.op)](ev(node.left, env), ev(node.right, env))
    if isinstance(node, ast.Compare):
        left = ev(node.left, env)
        for op, right_node in zip(node.ops, node.comparators):
            right = ev(right_node, env)
            if not _CMPOPS[type(op)](left, right):
                return False
            left = right
        return True
    if isinstance(node, ast.IfExp):
        return ev(node.body, env) if ev(node.test, env) else ev(node.orelse, env)
    if isinstance(node, ast.Call):
        return ev(node.func, env)(*[ev(a, env) for a in node.args], **{k.arg: ev(k.value, env) for k in node.keywords})
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        items = [ev(e, env) for e in node.elts]
        return {ast.List: list, ast.Tuple: tuple, ast.Set: set}[type(node)](items)
    if isinstance(node, ast.Dict):
        return {ev(k, env): ev(v, env) for k, v in zip(node.keys, node.values) if k is not None}
    if isinstance(node, ast.Subscript):
        return ev(node.value, env)[ev(node.slice, env)]
    if isinstance(node, ast.Slice):
        return slice(*(None if p is None else ev(p, env) for p in (node.lower, node.upper, node.step)))
    if isinstance(node, _COMPREHENSIONS):
        out = _comprehend(node.elt, node.generators, env)
        return set(out) if isinstance(node, ast.SetComp) else out
    if isinstance(node, ast.JoinedStr):
        return "".join(ev(v, env) if isinstance(v, ast.FormattedValue) else str(v.value) for v in node.values)
    if isinstance(node, ast.FormattedValue):
        value = ev(node.value, env)
        value = {115: str, 114: repr, 97: ascii}.get(node.conversion, lambda x: x)(value)
        return format(value, ev(node.format_spec, env) if node.format_spec is not None else "")
    raise _NotExpressible(f"{type(node).__name__} {ast.unparse(node)}")


def _comprehend(elt: ast.expr, generators: list[ast.comprehension], env: dict[str, Any]) -> list[Any]:
    if not generators:
        return [_evaluate(elt, env)]
    g, out = generators[0], []
    for item in _evaluate(g.iter, env):
        inner = {**env, g.target.id: item}  # type: ignore[attr-defined]
        if all(_evaluate(c, inner) for c in g.ifs):
            out += _comprehend(elt, generators[1:], inner)
    return out


def _template(node: ast.expr) -> str:
    """A raise's message as written: the f-string's text with each `{expression}` as in the
    source, or the string itself (braces doubled). `_message_node` turns it back."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value.replace("{", "{{").replace("}", "}}")
    if not isinstance(node, ast.JoinedStr):
        raise _NotExpressible(f"message {ast.unparse(node)} is not a string")
    parts = []
    for v in node.values:
        if isinstance(v, ast.Constant):
            parts.append(str(v.value).replace("{", "{{").replace("}", "}}"))
            continue
        assert isinstance(v, ast.FormattedValue)
        text = "{" + ast.unparse(v.value)
        if v.conversion != -1:
            text += "!" + chr(v.conversion)
        if v.format_spec is not None:
            text += ":" + _template(v.format_spec)
        parts.append(text + "}")
    return "".join(parts)


def _message_node(template: str) -> ast.expr:
    return _expr("f" + repr(template))


# --------------------------------------------------------------------------- SamplingParams.verify
def _module_constants(tree: ast.Module) -> dict[str, ast.expr]:
    out: dict[str, ast.expr] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            out[node.targets[0].id] = node.value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            out[node.target.id] = node.value
    return out


def _self_attrs(node: ast.AST) -> set[str]:
    return {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute) and _name(n.value) == "self"
            and isinstance(n.value, ast.Name)}


def _sampling_verify(pkg: _Package, cls: ast.ClassDef, fields: dict[str, str]) -> dict[str, Any]:
    """The checks of `SamplingParams.verify`: one rule per `raise ValueError(...)`, with the
    `if` / `for` chain around it, and the `__post_init__` steps that run before it."""
    rel = SAMPLING_PARAMS
    methods = {b.name: b for b in cls.body if isinstance(b, ast.FunctionDef)}
    verify = methods.get("verify")
    if verify is None:
        raise ContractScanError(f"sampling verify: SamplingParams in sglang/{rel} has no method `verify`")
    arguments = [a.arg for a in [*verify.args.posonlyargs, *verify.args.args][1:] + verify.args.kwonlyargs]
    module = _module_constants(pkg.tree(rel, "sampling verify"))
    defined: dict[str, str] = {}  # locals of verify, as assigned (the last assignment wins)
    rules: list[dict[str, Any]] = []
    calls: list[str] = []

    def walk(stmts: list[ast.stmt], chain: list[dict[str, str]]) -> None:
        for st in stmts:
            if isinstance(st, ast.If):
                test = ast.unparse(st.test)
                walk(st.body, [*chain, {"if": test}])
                walk(st.orelse, [*chain, {"if": f"not ({test})"}])
            elif isinstance(st, ast.For) and isinstance(st.target, ast.Name):
                walk(st.body, [*chain, {"for": st.target.id, "in": ast.unparse(st.iter)}])
            elif isinstance(st, (ast.With, ast.Try)):
                walk(st.body, chain)
            elif isinstance(st, ast.Raise) and isinstance(st.exc, ast.Call) and _name(st.exc.func) == "ValueError":
                rules.append(rule(st, chain))
            elif isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name):
                defined[st.targets[0].id] = ast.unparse(st.value)
            elif isinstance(st, ast.Expr) and isinstance(st.value, ast.Call):
                calls.append(f"{_where(rel, st)} {ast.unparse(st.value)}")

    def rule(st: ast.Raise, chain: list[dict[str, str]]) -> dict[str, Any]:
        where = _where(rel, st)
        guards, condition = (chain[:-1], chain[-1]["if"]) if chain and "if" in chain[-1] else (chain, "True")
        exc = st.exc
        assert isinstance(exc, ast.Call)
        if not exc.args:
            raise ContractScanError(f"sampling verify: the ValueError raised at sglang/{where} has no message")
        try:
            message = _template(exc.args[0])
            if ast.dump(_message_node(message)) != ast.dump(exc.args[0] if isinstance(exc.args[0], ast.JoinedStr)
                                                           else _message_node(message)):
                raise _NotExpressible(f"message {ast.unparse(exc.args[0])} does not survive as text")
        except (_NotExpressible, SyntaxError) as e:
            raise ContractScanError(f"sampling verify: the rule at sglang/{where}: {e}") from e
        loop_vars = {g["for"] for g in chain if "for" in g}
        texts = [g.get("if") or g["in"] for g in guards] + [condition, message]
        nodes = [_expr(t) for t in texts[:-1]] + [_message_node(message)]
        used = set().union(*(_free_names(n) for n in nodes))
        local_names = _closure(used & set(defined), {k: _expr(v) for k, v in defined.items()})
        order = [k for k in defined if k in local_names]
        try:
            for n in nodes + [_expr(defined[k]) for k in order]:
                _expressible(n, {"self", *arguments, *loop_vars, *defined, *module})
        except _NotExpressible as e:
            raise ContractScanError(f"sampling verify: the rule at sglang/{where} uses a {e}, which vlmrl's "
                                    "evaluator does not know; extend the expression language in "
                                    "vlmrl/contracts/sglang_contract.py") from e
        params = set().union(*(_self_attrs(n) for n in nodes[:-1] + [_expr(defined[k]) for k in order]))
        return {"condition": condition, "guards": guards, "message": message, "where": where,
                "parameters": sorted(params), "locals": [[k, defined[k]] for k in order]}

    walk(verify.body, [])
    if not rules:
        raise ContractScanError(f"sampling verify: SamplingParams.verify in sglang/{rel} raises no ValueError")
    post = _post_init(methods.get("__post_init__"), module, rel)
    # module constants the rules, the post-init steps and the field defaults read (and theirs)
    texts = [t for r in rules for t in [r["condition"], *(g.get("if") or g["in"] for g in r["guards"]),
                                          *(v for _, v in r["locals"])]]
    texts += _step_texts(post["steps"])
    defaults = [d for spec in fields.values() if (d := parse_field(spec)[2]) is not None]
    used = set().union(*(_free_names(_message_node(r["message"])) for r in rules))
    for t in texts + defaults:
        try:
            used |= _free_names(_expr(t))
        except SyntaxError:  # a default written in a way an expression cannot hold
            continue
    names = _closure(used & set(module), module)
    constants = []
    for k in module:
        if k in names:
            try:
                _expressible(module[k], set(module))
            except _NotExpressible:
                continue  # what reads it cannot be evaluated (a field default then stays None)
            constants.append([k, ast.unparse(module[k])])
    return {"where": f"{rel}:SamplingParams.verify", "arguments": arguments, "rules": rules,
            "unfollowed_calls": calls, "post_init": post, "constants": constants}


def _closure(names: set[str], defs: dict[str, ast.expr]) -> set[str]:
    """`names` and every name of `defs` their definitions read, transitively."""
    out, todo = set(), list(names)
    while todo:
        k = todo.pop()
        if k in out or k not in defs:
            continue
        out.add(k)
        todo += list(_free_names(defs[k]))
    return out


def _post_init(fn: ast.FunctionDef | None, module: dict[str, ast.expr], rel: str) -> dict[str, Any]:
    """`__post_init__` as nested steps: `{"set": target, "value": expr}`, `{"return": true}`,
    `{"if": test, "then": [...], "else": [...]}`; statements outside the expression language
    are listed under "skipped" (and not run by `verify_sampling_params`)."""
    skipped: list[str] = []
    local_names: set[str] = set()

    def ok(node: ast.AST) -> bool:
        try:
            _expressible(node, {"self", *module, *local_names})
        except _NotExpressible:
            return False
        return True

    def walk(stmts: list[ast.stmt]) -> list[dict[str, Any]]:
        steps: list[dict[str, Any]] = []
        for st in stmts:
            if isinstance(st, ast.If) and ok(st.test):
                steps.append({"if": ast.unparse(st.test), "then": walk(st.body), "else": walk(st.orelse)})
            elif isinstance(st, ast.Return) and st.value is None:
                steps.append({"return": True})
            elif (isinstance(st, ast.Assign) and len(st.targets) == 1 and ok(st.value)
                  and (isinstance(st.targets[0], ast.Name) or (isinstance(st.targets[0], ast.Attribute)
                                                               and _name(st.targets[0].value) == "self"))):
                target = st.targets[0]
                if isinstance(target, ast.Name):
                    local_names.add(target.id)
                steps.append({"set": ast.unparse(target), "value": ast.unparse(st.value)})
            elif not (isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant)):  # docstrings aside
                skipped.append(f"{_where(rel, st)} {ast.unparse(st).splitlines()[0]}")
        return steps

    return {"steps": walk(fn.body) if fn is not None else [], "skipped": skipped}


def _step_texts(steps: list[dict[str, Any]]) -> list[str]:
    out: list[str] = []
    for s in steps:
        if "if" in s:
            out += [s["if"], *_step_texts(s["then"]), *_step_texts(s["else"])]
        elif "value" in s:
            out.append(s["value"])
    return out


class _Return(Exception):
    """`return` inside __post_init__'s steps."""


def _run_steps(steps: list[tuple], obj: Any, env: dict[str, Any]) -> None:
    for kind, a, b, c in steps:
        if kind == "if":
            _run_steps(b if _evaluate(a, env) else c, obj, env)
        elif kind == "return":
            raise _Return
        else:
            value = _evaluate(b, env)
            if a.startswith("self."):
                setattr(obj, a[len("self."):], value)
            else:
                env[a] = value


def _compile_steps(steps: list[dict[str, Any]]) -> list[tuple]:
    out: list[tuple] = []
    for s in steps:
        if "if" in s:
            out.append(("if", _expr(s["if"]), _compile_steps(s["then"]), _compile_steps(s["else"])))
        elif s.get("return"):
            out.append(("return", None, None, None))
        else:
            out.append(("set", s["set"], _expr(s["value"]), None))
    return out


@functools.cache
def _verifier(version: str) -> _Verifier:
    return _Verifier(load_contract(version)["sampling_params"])


class _Verifier:
    """SamplingParams of one SGLang release, as its contract records them: field defaults,
    `__post_init__` steps, then the verify rules in order."""

    def __init__(self, sp: dict[str, Any]) -> None:
        v = sp["verify"]
        self.constants: dict[str, Any] = {}
        for name, text in v["constants"]:
            try:
                self.constants[name] = _evaluate(_expr(text), self.constants)
            except Exception:  # noqa: BLE001 (a constant that needs more than the expression language)
                continue
        self.defaults: dict[str, Any] = {}
        for name, spec in sp["fields"].items():
            default = parse_field(spec)[2]
            try:
                self.defaults[name] = None if default is None else _evaluate(_expr(default), self.constants)
            except Exception:  # noqa: BLE001
                self.defaults[name] = None
        self.steps = _compile_steps(v["post_init"]["steps"])
        self.arguments = tuple(v["arguments"])
        self.rules = []
        for r in v["rules"]:
            guards = [(g["for"], _expr(g["in"])) if "for" in g else (None, _expr(g["if"])) for g in r["guards"]]
            condition, message = _expr(r["condition"]), _message_node(r["message"])
            local_defs = [(k, _expr(t)) for k, t in r["locals"]]
            nodes = [n for _, n in guards] + [condition, message] + [n for _, n in local_defs]
            reads = frozenset(a for a in self.arguments if any(a in _free_names(n) for n in nodes))
            self.rules.append((r, guards, condition, message, local_defs, reads))

    def check(self, params: dict[str, Any], arguments: dict[str, Any]) -> str | None:
        import types

        fields = {**self.defaults, **params}
        obj = types.SimpleNamespace(**fields)
        env: dict[str, Any] = {**self.constants, "self": obj}
        try:
            _run_steps(self.steps, obj, env)
        except _Return:
            pass
        except Exception as e:  # noqa: BLE001
            return f"invalid sampling parameters {sorted(params)}: {type(e).__name__}: {e}"
        base = {**self.constants, "self": obj, **arguments}
        for rule, guards, condition, message, local_defs, reads in self.rules:
            if any(arguments.get(a) is None for a in reads):
                continue  # e.g. the vocabulary size, when the caller does not know it
            try:
                env = dict(base)
                for k, node in local_defs:
                    env[k] = _evaluate(node, env)
                hit = self._hit(guards, condition, env)
                if hit is not None:
                    return str(_evaluate(message, hit))
            except Exception as e:  # noqa: BLE001 (a value of the wrong type: SGLang fails on it too)
                return (f"invalid sampling parameters {rule['parameters']}: {type(e).__name__}: {e} "
                        f"(checking `{rule['condition']}`)")
        return None

    def _hit(self, guards: list[tuple[str | None, ast.expr]], condition: ast.expr,
             env: dict[str, Any]) -> dict[str, Any] | None:
        if not guards:
            return env if _evaluate(condition, env) else None
        (var, node), rest = guards[0], guards[1:]
        if var is None:
            return self._hit(rest, condition, env) if _evaluate(node, env) else None
        for item in _evaluate(node, env):
            if (hit := self._hit(rest, condition, {**env, var: item})) is not None:
                return hit
        return None


def verify_sampling_params(params: dict[str, Any], *, version: str | None = None,
                           vocab_size: int | None = None) -> str | None:
    """SGLang's own message for the first check of `SamplingParams.verify` that `params` (one
    request's sampling_params object) fail in release `version` (None: the newest known), after
    that release's field defaults and `__post_init__`, or None when they pass. A check that
    reads `vocab_size` passes when it is None."""
    return _verifier(resolve_version(version)).check(dict(params or {}), {"vocab_size": vocab_size})


# --------------------------------------------------------------------------- generate replies
def _is_meta(node: ast.AST, names: set[str]) -> bool:
    """`meta_info` (one of names), `x["meta_info"]` or `x.get("meta_info")`."""
    if isinstance(node, ast.Name):
        return node.id in names
    if isinstance(node, ast.Subscript):
        return _str(node.slice) == "meta_info"
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
            and bool(node.args) and _str(node.args[0]) == "meta_info")


def _dict_keys(node: ast.AST) -> set[str]:
    return {k for k in (_str(key) for key in node.keys) if k is not None} if isinstance(node, ast.Dict) else set()


def _meta_writes(fn: ast.AST, names: set[str]) -> set[str]:
    keys: set[str] = set()
    for node in ast.walk(fn):
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        for t in targets:
            if isinstance(t, ast.Name) and t.id in names:
                keys |= _dict_keys(getattr(node, "value", None))
            elif isinstance(t, ast.Subscript) and _is_meta(t.value, names) and (k := _str(t.slice)) is not None:
                keys.add(k)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and _is_meta(node.func.value, names):
            if node.func.attr == "update":
                for a in node.args:
                    keys |= _dict_keys(a)
                keys.update(k.arg for k in node.keywords if k.arg)
            elif node.func.attr == "setdefault" and node.args and (k := _str(node.args[0])) is not None:
                keys.add(k)
    return keys


def _callee_param(pkg: _Package, rel: str, classes: list[ast.ClassDef], call: ast.Call,
                  index: int | None, keyword: str | None) -> tuple[str, ast.AST, str] | None:
    """(file, function, parameter name) receiving argument `index` / `keyword` of `call`."""
    func, offset, fn_rel = None, 0, rel
    if isinstance(call.func, ast.Name):
        target = pkg.imports(rel).get(call.func.id)
        if target is not None:
            fn_rel, func = target[0], pkg.top(target[0], target[1], (ast.FunctionDef, ast.AsyncFunctionDef))
        else:
            func = pkg.top(rel, call.func.id, (ast.FunctionDef, ast.AsyncFunctionDef))
    elif isinstance(call.func, ast.Attribute) and _name(call.func.value) == "self":
        for cls in classes:
            func = next((b for b in cls.body if isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef))
                         and b.name == call.func.attr), None)
            if func is not None:
                is_static = any(_name(d) == "staticmethod" for d in func.decorator_list)
                offset = 0 if is_static else 1
                break
    if func is None:
        return None
    params = [*func.args.posonlyargs, *func.args.args]
    if keyword is not None:
        return fn_rel, func, keyword
    if index is not None and index + offset < len(params):
        return fn_rel, func, params[index + offset].arg
    return None


def _generate_reply(pkg: _Package) -> dict[str, Any]:
    rel = TOKENIZER_MANAGER
    tree = pkg.tree(rel, "generate meta_info")
    classes = [n for n in tree.body if isinstance(n, ast.ClassDef)]
    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    keys: set[str] = set()
    sources: set[str] = set()
    built = False
    reply_keys: set[str] = set()
    for fn in functions:
        found = _meta_writes(fn, {"meta_info"})
        if found:
            keys |= found
            sources.add(f"{rel}:{fn.name}")
        for node in ast.walk(fn):
            if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "meta_info"
                                                     for t in node.targets) and isinstance(node.value, ast.Dict)):
                built = True
            # the meta_info dict handed to another function: follow it one call deep
            if isinstance(node, ast.Call):
                hits = [(i, None) for i, a in enumerate(node.args) if _is_meta(a, {"meta_info"})]
                hits += [(None, k.arg) for k in node.keywords if k.arg and _is_meta(k.value, {"meta_info"})]
                for index, kw in hits:
                    callee = _callee_param(pkg, rel, classes, node, index, kw)
                    if callee is not None and (more := _meta_writes(callee[1], {callee[2]})):
                        keys |= more
                        sources.add(f"{callee[0]}:{callee[1].name}")  # type: ignore[attr-defined]
        # reply dicts: literals holding "meta_info", and keys set on the names bound to them
        reply_names: set[str] = set()
        for node in ast.walk(fn):
            if isinstance(node, ast.Dict) and "meta_info" in _dict_keys(node):
                reply_keys |= _dict_keys(node)
            if isinstance(node, ast.Assign) and "meta_info" in _dict_keys(node.value):
                reply_names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign):
                for t in node.targets:
                    if (isinstance(t, ast.Subscript) and _name(t.value) in reply_names
                            and (k := _str(t.slice)) is not None):
                        reply_keys.add(k)
    if not built or "finish_reason" not in keys:
        raise ContractScanError(
            f"generate meta_info: no `meta_info = {{...}}` with 'finish_reason' in sglang/{rel} "
            f"(found keys {sorted(keys)}); the tokenizer manager changed shape, update the scanner")
    if "meta_info" not in reply_keys:
        raise ContractScanError(f"generate reply: no reply dict holding 'meta_info' in sglang/{rel}")
    return {"meta_info_keys": sorted(keys), "meta_info_sources": sorted(sources), "response_keys": sorted(reply_keys),
            "finish_reasons": _finish_reasons(pkg)}


def _finish_reasons(pkg: _Package) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for cls in pkg.tree(SCHEDULE_BATCH, "finish reasons").body:
        if not isinstance(cls, ast.ClassDef):
            continue
        to_json = next((b for b in cls.body if isinstance(b, ast.FunctionDef) and b.name == "to_json"), None)
        ret = next((n.value for n in ast.walk(to_json) if isinstance(n, ast.Return)), None) if to_json else None
        if isinstance(ret, ast.Dict) and "type" in _dict_keys(ret):
            type_value = next((_str(v) for k, v in zip(ret.keys, ret.values) if _str(k) == "type"), None)
            out[cls.name] = {"keys": sorted(_dict_keys(ret)), "type": type_value}
    if not out:
        raise ContractScanError(f"finish reasons: no class with a `to_json` returning {{'type': ...}} in "
                                f"sglang/{SCHEDULE_BATCH}")
    return out


# --------------------------------------------------------------------------- memory tags
def _memory(pkg: _Package) -> dict[str, Any]:
    consts: dict[str, Any] = {}
    all_types: list[str] | None = None
    for node in pkg.tree(CONSTANTS, "memory tags").body:
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
            continue
        name = node.targets[0].id
        if name.startswith("GPU_MEMORY_TYPE_") and (s := _str(node.value)) is not None:
            consts[name] = s
        elif name == "GPU_MEMORY_ALL_TYPES" and isinstance(node.value, (ast.List, ast.Tuple)):
            all_types = [consts.get(_name(e) or "", _str(e)) for e in node.value.elts]  # type: ignore[misc]
    if not consts:
        raise ContractScanError(f"memory tags: no GPU_MEMORY_TYPE_* string constants in sglang/{CONSTANTS}")
    if all_types is None or None in all_types:
        raise ContractScanError(f"memory tags: GPU_MEMORY_ALL_TYPES is not a list of the GPU_MEMORY_TYPE_* "
                                f"constants in sglang/{CONSTANTS}")
    named = {**consts, "GPU_MEMORY_ALL_TYPES": all_types}
    no_tags: dict[str, list[dict[str, Any]]] = {}
    for rel in sorted(r for r, text in pkg.files.items() if any(f"def {c}(" in text for c in _MEMORY_CALLS)):
        for fn in ast.walk(pkg.tree(rel, "memory tags")):
            if not (isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn.name in _MEMORY_CALLS):
                continue
            for node in ast.walk(fn):
                if not (isinstance(node, ast.If) and "tags is None" in ast.unparse(node.test)):
                    continue
                for stmt in node.body:
                    if (isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "tags"
                                                             for t in stmt.targets)):
                        value = stmt.value
                        tags = named.get(_name(value) or "")
                        if tags is None:
                            try:
                                tags = list(ast.literal_eval(value))
                            except ValueError:
                                tags = None
                        no_tags.setdefault(fn.name, []).append(
                            {"value": ast.unparse(value), "tags": tags, "where": _where(rel, stmt)})
    missing = [c for c in _MEMORY_CALLS if c not in no_tags]
    if missing:
        raise ContractScanError(f"memory tags: found no `if tags is None ...: tags = ...` in {missing} anywhere "
                                "in sglang/srt; find where a call without tags is defaulted and update the scanner")
    # the release's precondition: `assert <idle>, "message"` where the release is carried out
    idle = None
    for rel in sorted({site["where"].rsplit(":", 1)[0] for site in no_tags["release_memory_occupation"]}):
        for fn in ast.walk(pkg.tree(rel, "memory release")):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn.name == "release_memory_occupation":
                for node in ast.walk(fn):
                    if isinstance(node, ast.Assert) and (msg := _str(node.msg)) is not None and idle is None:
                        idle = {"condition": ast.unparse(node.test), "message": msg, "where": _where(rel, node)}
    if idle is None:
        raise ContractScanError("memory release: no `assert ..., \"message\"` in the release_memory_occupation "
                                "that defaults its tags; find what SGLang requires before a release")
    return {"all_types": all_types, "no_tags": no_tags, "release_requires_idle": idle, "tags": consts}


# --------------------------------------------------------------------------- loads, server info
def _returned_dict_keys(fn: ast.AST) -> set[str]:
    """String keys of the dict literals a handler returns (directly or wrapped in a call)."""
    keys: set[str] = set()
    for ret in (n for n in ast.walk(fn) if isinstance(n, ast.Return) and n.value is not None):
        for node in ast.walk(ret.value):
            keys |= _dict_keys(node)
    return keys


def _loads(pkg: _Package, routes: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"endpoint": LOADS_PATH in routes["endpoints"],
                           "server_info": SERVER_INFO_PATH in routes["endpoints"]}
    if out["endpoint"]:
        if LOAD_SNAPSHOT not in pkg.files:
            raise ContractScanError(f"loads: {LOADS_PATH} is served but sglang/{LOAD_SNAPSHOT} is not in the source")
        cls = pkg.top(LOAD_SNAPSHOT, "LoadSnapshot", ast.ClassDef)
        if cls is None:
            raise ContractScanError(f"loads: no class LoadSnapshot in sglang/{LOAD_SNAPSHOT}")
        fields = [b.target.id for b in cls.body if isinstance(b, ast.AnnAssign) and isinstance(b.target, ast.Name)
                  and not ast.unparse(b.annotation).startswith(("ClassVar", "typing.ClassVar"))]
        sections = _module_constants(pkg.tree(LOAD_SNAPSHOT, "loads")).get("_SECTION_FIELDS")
        try:  # frozenset({...}) of the sub-sections; every other field is a core key
            if isinstance(sections, ast.Call) and _name(sections.func) in ("frozenset", "set"):
                names = ast.literal_eval(sections.args[0]) if sections.args else ()
            else:
                names = ast.literal_eval(sections)
        except (ValueError, AttributeError, IndexError) as e:
            raise ContractScanError(f"loads: no literal `_SECTION_FIELDS = frozenset({{...}})` in "
                                    f"sglang/{LOAD_SNAPSHOT}; find how the core keys are told from the sections") from e
        out["core_keys"] = [f for f in fields if f not in set(names)]
        out["sections"] = sorted(set(names))
        if not {"num_running_reqs", "num_waiting_reqs"} <= set(out["core_keys"]):
            raise ContractScanError(f"loads: LoadSnapshot in sglang/{LOAD_SNAPSHOT} has no num_running_reqs / "
                                    f"num_waiting_reqs (core keys found: {out['core_keys']})")
        rel, fn = routes["_fns"][LOADS_PATH]
        out["reply_keys"] = sorted(_returned_dict_keys(fn))
        if "loads" not in out["reply_keys"]:
            raise ContractScanError(f"loads: the handler of {LOADS_PATH} ({_where(rel, fn)}) returns no dict "
                                    "literal with 'loads'")
    else:
        out["core_keys"] = out["sections"] = out["reply_keys"] = None
    if out["server_info"]:
        rel, fn = routes["_fns"][SERVER_INFO_PATH]
        keys = _returned_dict_keys(fn)
        if not keys:
            raise ContractScanError(f"server info: the handler of {SERVER_INFO_PATH} ({_where(rel, fn)}) returns "
                                    "no dict literal")
        out["server_info_keys"] = sorted(keys)
        out["server_info_version"] = "version" in keys
    else:
        out["server_info_keys"], out["server_info_version"] = None, False
    return out


# --------------------------------------------------------------------------- weight-update sessions
def _weight_update(pkg: _Package, endpoints: dict[str, Any]) -> dict[str, Any]:
    """Whether the release has weight-update sessions (both endpoints), and which calls of the
    class that opens them refuse to run outside one: methods whose body tests the attribute
    `begin_weight_update` sets (`if self.<attr> is None: return ...`)."""
    session = all(p in endpoints for p in SESSION_PATHS)
    out: dict[str, Any] = {"session": session, "session_required": [], "where": None}
    if not session:
        return out
    for rel in sorted(r for r, text in pkg.files.items() if "def begin_weight_update(" in text
                      and "def end_weight_update(" in text):
        for cls in (n for n in ast.walk(pkg.tree(rel, "weight update")) if isinstance(n, ast.ClassDef)):
            methods = {b.name: b for b in cls.body if isinstance(b, ast.FunctionDef)}
            begin = methods.get("begin_weight_update")
            if begin is None or "end_weight_update" not in methods:
                continue
            state = {t.attr for n in ast.walk(begin) if isinstance(n, ast.Assign) for t in n.targets
                     if isinstance(t, ast.Attribute) and _name(t.value) == "self"}
            required = []
            for name, fn in methods.items():
                if name in ("begin_weight_update", "end_weight_update"):
                    continue
                for node in ast.walk(fn):
                    if (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
                            and isinstance(node.test.ops[0], ast.Is) and _name(node.test.left) in state
                            and isinstance(node.test.left, ast.Attribute) and _name(node.test.left.value) == "self"
                            and any(isinstance(s, (ast.Return, ast.Raise)) for s in node.body)):
                        required.append(name)
                        break
            if state:
                out["session_required"] = sorted("/" + n for n in required if "/" + n in endpoints)
                out["where"] = f"{rel}:{cls.name}"
                return out
    raise ContractScanError(f"weight update: {' and '.join(SESSION_PATHS)} are served but no class in sglang/srt "
                            "defines begin_weight_update and end_weight_update with a session attribute")


# --------------------------------------------------------------------------- the weight loader vlmrl gives SGLang
def _weight_loader(pkg: _Package) -> dict[str, Any]:
    """What vlmrl's loader inside the server (`vlmrl/rollout/sglang_plugin`) relies on: the
    weight updater calls a loader named in `custom_weight_loaders` with the model and the
    (name, tensor) pairs; `UnquantizedFusedMoEMethod` registers the fused expert parameters and
    sets the attributes that say whether they keep the checkpoint layout; Qwen3.5's loader maps
    transformers' fused expert names onto those parameters."""
    out: dict[str, Any] = {}
    for rel in sorted(r for r, text in pkg.files.items() if r.startswith("srt/") and "custom_weight_loaders" in text):
        for fn in ast.walk(pkg.tree(rel, "custom weight loader")):
            if not isinstance(fn, ast.FunctionDef) or fn.name != "update_weights_from_tensor":
                continue
            named = any(isinstance(n, ast.Compare) and any(isinstance(o, ast.In) for o in n.ops)
                        and _name(n.comparators[0]) == "custom_weight_loaders" for n in ast.walk(fn))
            loaders = {t.id for n in ast.walk(fn) if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call)
                       and _name(n.value.func) == "dynamic_import" for t in n.targets if isinstance(t, ast.Name)}
            calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                     and n.func.id in loaders and len(n.args) == 2]
            if named and calls:
                out["custom_loader"] = {"where": f"{rel}:{fn.name}", "call": ast.unparse(calls[0])}
    if "custom_loader" not in out:
        raise ContractScanError("custom weight loader: no update_weights_from_tensor in sglang/srt calls a loader "
                                "named in custom_weight_loaders (imported with dynamic_import)")
    for rel in sorted(r for r, text in pkg.files.items() if "class UnquantizedFusedMoEMethod" in text):
        for cls in ast.walk(pkg.tree(rel, "fused MoE method")):
            if not isinstance(cls, ast.ClassDef) or cls.name != "UnquantizedFusedMoEMethod":
                continue
            methods = {b.name: b for b in cls.body if isinstance(b, ast.FunctionDef)}
            init, create = methods.get("__init__"), methods.get("create_weights")
            if init is None or create is None:
                continue
            attributes = {t.attr for n in ast.walk(init) if isinstance(n, (ast.Assign, ast.AnnAssign))
                          for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                          if isinstance(t, ast.Attribute) and _name(t.value) == "self"}
            parameters = {_str(n.args[0]) for n in ast.walk(create) if isinstance(n, ast.Call)
                          and _name(n.func) == "register_parameter" and n.args and _str(n.args[0])}
            out["unquantized_moe"] = {"where": f"{rel}:{cls.name}", "init_attributes": sorted(attributes),
                                      "parameters": sorted(parameters)}
    if "unquantized_moe" not in out:
        raise ContractScanError("fused MoE method: no class UnquantizedFusedMoEMethod with __init__ and "
                                "create_weights in sglang/srt")
    pairs = set()
    for node in ast.walk(pkg.tree(QWEN3_5_MODEL, "Qwen3.5 fused experts")):
        if (isinstance(node, ast.Assign) and any(_name(t) == "fused_expert_params_mapping" for t in node.targets)
                and isinstance(node.value, ast.List)):
            for item in node.value.elts:
                if isinstance(item, ast.Tuple) and len(item.elts) >= 2 and all(_str(e) for e in item.elts[:2]):
                    pairs.add((_str(item.elts[0]), _str(item.elts[1])))
    if not pairs:
        raise ContractScanError(f"Qwen3.5 fused experts: sglang/{QWEN3_5_MODEL} assigns no "
                                "fused_expert_params_mapping list of (parameter, checkpoint name) tuples")
    out["qwen3_5_fused_experts"] = sorted([list(p) for p in pairs])
    return out


# --------------------------------------------------------------------------- model configs
def _class_attr(cls: ast.ClassDef, name: str) -> ast.expr | None:
    for b in cls.body:
        if isinstance(b, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in b.targets):
            return b.value
    return None


def _chain(pkg: _Package, rel: str, cls: ast.ClassDef) -> tuple[list[tuple[str, ast.ClassDef]], list[str]]:
    """The class and its bases inside the package, most derived first (depth first, each once),
    and the names of the bases outside it."""
    chain: list[tuple[str, ast.ClassDef]] = []
    outside: list[str] = []

    def visit(r: str, c: ast.ClassDef) -> None:
        if any(c is seen for _, seen in chain):
            return
        chain.append((r, c))
        for base in c.bases:
            name = _name(base)
            found = pkg.resolve_class(r, name) if name else None
            if found is not None:
                visit(*found)
            elif name and name not in outside:
                outside.append(name)

    visit(rel, cls)
    return chain, outside


def _literal_or_source(node: ast.expr) -> Any:
    try:
        return ast.literal_eval(node)
    except ValueError:
        return {"source": ast.unparse(node)}


def _config_class(pkg: _Package, rel: str, cls: ast.ClassDef) -> dict[str, Any]:
    chain, outside = _chain(pkg, rel, cls)
    inits = [(r, c, next((b for b in c.body if isinstance(b, ast.FunctionDef) and b.name == "__init__"), None))
             for r, c in chain]
    if not any(fn is not None for _, _, fn in inits):
        raise ContractScanError(f"model configs: no __init__ in {cls.name} or its bases in sglang/")
    defaults: dict[str, Any] = {}
    assigned: set[str] = set()
    defined: set[str] = set()
    reads: set[str] = set()
    for _, c, fn in reversed(inits):  # bases first: a subclass's default wins
        defined |= {b.name for b in c.body if isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef))}
        defined |= {t.id for b in c.body if isinstance(b, ast.Assign) for t in b.targets if isinstance(t, ast.Name)}
        defined |= {b.target.id for b in c.body if isinstance(b, ast.AnnAssign) and isinstance(b.target, ast.Name)}
        for method in (b for b in c.body if isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef))):
            reads |= {n.attr for n in ast.walk(method) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load)
                      and isinstance(n.value, ast.Name) and n.value.id == "self"}
        if fn is None:
            continue
        a = fn.args
        positional = [*a.posonlyargs, *a.args][1:]
        pos_defaults: list[ast.expr | None] = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
        for arg, d in [*zip(positional, pos_defaults), *zip(a.kwonlyargs, a.kw_defaults)]:
            if d is not None:
                defaults[arg.arg] = _literal_or_source(d)
        kwargs = a.kwarg.arg if a.kwarg else None
        for n in ast.walk(fn):
            # kwargs.pop("k", default) / kwargs.get("k", default): a keyword the class reads by hand
            if (kwargs and isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                    and n.func.attr in ("pop", "get") and _name(n.func.value) == kwargs and len(n.args) == 2
                    and (k := _str(n.args[0])) is not None and k not in defaults):
                defaults[k] = _literal_or_source(n.args[1])
            targets = n.targets if isinstance(n, ast.Assign) else (
                [n.target] if isinstance(n, (ast.AnnAssign, ast.AugAssign)) else [])
            for t in targets:
                for e in ast.walk(t):
                    if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self":
                        assigned.add(e.attr)
            if (isinstance(n, ast.Call) and _name(n.func) == "setattr" and len(n.args) >= 2
                    and _name(n.args[0]) == "self" and (k := _str(n.args[1])) is not None):
                assigned.add(k)
    return {"class": cls.name, "chain": [f"{r}:{c.name}" for r, c in chain], "bases_outside": outside,
            "defaults": defaults, "required": sorted(reads - assigned - defined)}


def _model_configs(pkg: _Package) -> dict[str, Any]:
    configs = sorted(r for r in pkg.files if r.startswith(CONFIGS_DIR))
    out: dict[str, Any] = {}
    for model_type in MODEL_CONFIG_TYPES:
        found = None
        for rel in configs:
            for cls in pkg.tree(rel, "model configs").body:
                if (isinstance(cls, ast.ClassDef) and _str(_class_attr(cls, "model_type")) == model_type
                        and isinstance(_class_attr(cls, "sub_configs"), ast.Dict)):
                    found = (rel, cls)
                    break
            if found:
                break
        if found is None:
            raise ContractScanError(f"model configs: no class with model_type = {model_type!r} and a sub_configs "
                                    f"dict under sglang/{CONFIGS_DIR}")
        rel, top = found
        subs = _class_attr(top, "sub_configs")
        assert isinstance(subs, ast.Dict)
        by_key = {_str(k): v for k, v in zip(subs.keys, subs.values)}
        entry: dict[str, Any] = {"class": top.name, "where": f"{rel}:{top.name}"}
        for role, key in (("text", "text_config"), ("vision", "vision_config")):
            name = _name(by_key[key]) if key in by_key else None
            sub = pkg.resolve_class(rel, name) if name else None
            if sub is None:
                raise ContractScanError(f"model configs: {top.name}.sub_configs in sglang/{rel} has no {key!r} "
                                        "class of the sglang package")
            entry[role] = _config_class(pkg, *sub)
        out[model_type] = entry
    return out


# --------------------------------------------------------------------------- JSON schema
def _api_schema(pkg: _Package) -> dict[str, Any] | None:
    if API_TYPES not in pkg.files:
        return None
    tree = pkg.tree(API_TYPES, "api schema")
    decoders = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("decode_")}
    out: dict[str, Any] = {}
    for cls in tree.body:
        if not (isinstance(cls, ast.ClassDef) and any(ast.unparse(b).endswith("Struct") for b in cls.bases)):
            continue
        dec = decoders.get("decode_" + cls.name)
        rejects = dec is not None and any(isinstance(n, ast.Call) and _name(n.func) == "_unknown_field"
                                          for n in ast.walk(dec))
        out[cls.name] = {"fields": _class_fields(pkg, API_TYPES, cls),
                         "unknown_keys": "rejected" if rejects else "ignored"}
    if "GenerateRequest" not in out or "SamplingParams" not in out:
        raise ContractScanError(f"api schema: sglang/{API_TYPES} has no GenerateRequest / SamplingParams struct")
    return out


# --------------------------------------------------------------------------- the contract
def scan_contract(source: str | Path) -> dict[str, Any]:
    """The contract of an SGLang wheel (.whl) or unpacked package directory, as plain data
    (see the module docstring for what each key holds). Raises ContractScanError when a
    piece cannot be found."""
    files, version = _sources(source, CONTRACT_SOURCES)
    if not files:
        raise ContractScanError(f"no sglang/ sources under {source}")
    pkg = _Package(files)
    tree = pkg.tree(HTTP_SERVER, "routes")
    owners = _app_names(tree)
    if not owners:
        raise ContractScanError(f"routes: no `app = FastAPI(...)` in sglang/{HTTP_SERVER}")
    routes: dict[str, Any] = {"endpoints": {}, "endpoint_handlers": {}, "_requests": {}, "_structs": {},
                              "_fns": {}, "unresolved_routes": []}
    _scan_routes(pkg, HTTP_SERVER, owners, "", routes)
    # path -> struct when all its methods take the same one, else "METHOD path" -> struct
    routes["endpoint_requests"] = {}
    for path in routes["endpoints"]:
        per_method = {m: s for (p, m), s in routes["_requests"].items() if p == path}
        if len(set(per_method.values())) == 1:
            if (only := next(iter(per_method.values()))) is not None:
                routes["endpoint_requests"][path] = only
        else:
            routes["endpoint_requests"].update({f"{m} {path}": s for m, s in per_method.items() if s is not None})
    if "/generate" not in routes["endpoints"] or "/generate" not in routes["endpoint_requests"]:
        raise ContractScanError(f"routes: no /generate route with a request class in sglang/{HTTP_SERVER} "
                                f"(found {len(routes['endpoints'])} routes)")
    request_structs: dict[str, Any] = {}
    response_structs: dict[str, Any] = {}
    for name, (rel, cls) in sorted(routes["_structs"].items()):
        request_structs[name] = _class_fields(pkg, rel, cls)
        if name.endswith("ReqInput") and (out := pkg.resolve_class(rel, name[: -len("Input")] + "Output")):
            response_structs[out[1].name] = _class_fields(pkg, out[0], out[1])
    return {
        "about": "SGLang's native HTTP contract read from its source with ast by vlmrl/contracts/sglang_contract.py "
                 "(its docstring says what each key holds and how robust it is); regenerate with "
                 f"`make sglang-contract SGLANG_VERSION={version}`.",
        "sglang_version": version,
        "endpoints": {p: sorted(m) for p, m in routes["endpoints"].items()},
        "endpoint_handlers": {p: sorted(h) for p, h in routes["endpoint_handlers"].items()},
        "endpoint_requests": routes["endpoint_requests"],
        "unresolved_routes": sorted(routes["unresolved_routes"]),
        "request_structs": request_structs,
        "response_structs": response_structs,
        "sampling_params": _sampling_params(pkg),
        "generate": _generate_reply(pkg),
        "memory": _memory(pkg),
        "api_schema": _api_schema(pkg),
        "loads": _loads(pkg, routes),
        "weight_update": _weight_update(pkg, routes["endpoints"]),
        "weight_loader": _weight_loader(pkg),
        "model_configs": _model_configs(pkg),
    }


def format_contract(contract: dict[str, Any], command: str) -> str:
    """The JSON text (sorted keys, so regenerating from the same wheel gives no diff)."""
    return json.dumps({**contract, "generated_by": command}, indent=1, sort_keys=True) + "\n"


def load_contract(version: str | None = None) -> dict[str, Any]:
    """The contract of SGLang `version` (None: the newest vlmrl has; an unknown one raises
    UnknownSGLangVersion naming the known ones and the command that adds one)."""
    return _load(resolve_version(version))


@functools.cache
def _load_text(version: str) -> str:
    return contract_file(version).read_text()


def _load(version: str) -> dict[str, Any]:
    return json.loads(_load_text(version))


@dataclass(frozen=True)
class SGLangProtocol:
    """What one SGLang release's HTTP protocol offers, derived from its contract alone."""

    version: str
    weight_update_session: bool  # /begin_weight_update and /end_weight_update exist
    session_required: frozenset[str]  # the calls such a release refuses outside a session
    loads: bool  # /v1/loads exists
    loads_core_keys: tuple[str, ...]  # the per-rank keys of its reply (include=core)
    loads_reply_keys: tuple[str, ...]  # the keys of its reply
    server_info: bool  # /server_info exists
    server_info_version: bool  # ... and its reply carries "version"
    server_info_keys: tuple[str, ...]  # the literal keys of its reply
    release_requires_idle: str  # what SGLang asserts before releasing memory (its message)


def protocol(version: str | None = None) -> SGLangProtocol:
    """The protocol of SGLang `version` (None: the newest vlmrl has a contract for)."""
    return _protocol(resolve_version(version))


@functools.cache
def _protocol(version: str) -> SGLangProtocol:
    c = _load(version)
    endpoints, loads, update = c["endpoints"], c["loads"], c["weight_update"]
    return SGLangProtocol(
        version=c["sglang_version"],
        weight_update_session=all(p in endpoints for p in SESSION_PATHS),
        session_required=frozenset(update["session_required"]),
        loads=LOADS_PATH in endpoints,
        loads_core_keys=tuple(loads["core_keys"] or ()),
        loads_reply_keys=tuple(loads["reply_keys"] or ()),
        server_info=SERVER_INFO_PATH in endpoints,
        server_info_version=bool(loads["server_info_version"]),
        server_info_keys=tuple(loads["server_info_keys"] or ()),
        release_requires_idle=c["memory"]["release_requires_idle"]["message"],
    )
