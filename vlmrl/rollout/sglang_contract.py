"""SGLang's native HTTP contract, read from its source with `ast` (SGLang is never imported).

`sglang_contract.json` is to SGLang's HTTP API what `sglang_flags.txt` is to its ServerArgs:
a committed record of one SGLang release, written by scanning the wheel's source, that
the tests hold vlmrl's client, embedded server and launcher against
(tests/unit/test_sglang_contract.py). Regenerate both files with `make sglang-contract`, or
this one alone with

    pip download --no-deps sglang==0.5.23 -d /tmp/sg
    python -m vlmrl.rollout.sglang contract --source /tmp/sg/sglang-0.5.23-*.whl \\
        --out vlmrl/rollout/sglang_contract.json

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
- `sampling_params`: the arguments of `SamplingParams.__init__` in
  `srt/sampling/sampling_params.py`, or its class-level fields when it has no `__init__`
  (a msgspec Struct since 0.5.2x; its internal fields are init arguments too).
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
  (`if tags is None ...: tags = X`) and what X holds.
- `api_schema` (SGLang 0.5.2x; null when the wheel has no `api/v1/api_types.py`): the
  generated JSON schema `/generate` bodies are checked against before the dataclass sees
  them: each struct's fields and whether it rejects unknown keys (its `decode_<Name>`
  raises `_unknown_field`) or ignores them. `SamplingParams` rejects them: an unknown
  sampling key is an HTTP 400, not silently dropped.

The JSON is written with sorted keys, so regenerating from the same wheel gives no diff.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

from .sglang_flags import _sources

CONTRACT_FILE = Path(__file__).with_name("sglang_contract.json")

# the files the scan may read (paths under sglang/ containing one of these)
CONTRACT_SOURCES = ("srt/", "api/", "version.py")

HTTP_SERVER = "srt/entrypoints/http_server.py"
TOKENIZER_MANAGER = "srt/managers/tokenizer_manager.py"
SAMPLING_PARAMS = "srt/sampling/sampling_params.py"
CONSTANTS = "srt/constants.py"
SCHEDULE_BATCH = "srt/managers/schedule_batch.py"
API_TYPES = "api/v1/api_types.py"

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


def _sampling_params(pkg: _Package) -> dict[str, str]:
    cls = pkg.top(SAMPLING_PARAMS, "SamplingParams", ast.ClassDef) if SAMPLING_PARAMS in pkg.files else None
    if cls is None:
        raise ContractScanError(f"sampling params: no class SamplingParams in sglang/{SAMPLING_PARAMS}")
    init = next((b for b in cls.body if isinstance(b, ast.FunctionDef) and b.name == "__init__"), None)
    args = _init_args(init) if init is not None else _class_fields(pkg, SAMPLING_PARAMS, cls)
    if not args:
        raise ContractScanError(f"sampling params: SamplingParams in sglang/{SAMPLING_PARAMS} has no fields")
    return args


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
    return {"all_types": all_types, "no_tags": no_tags, "tags": consts}


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
                              "unresolved_routes": []}
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
        "about": "SGLang's native HTTP contract read from its source with ast by vlmrl/rollout/sglang_contract.py "
                 "(its docstring says what each key holds and how robust it is); regenerate with "
                 "`make sglang-contract`.",
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
    }


def format_contract(contract: dict[str, Any], command: str) -> str:
    """The JSON text (sorted keys, so regenerating from the same wheel gives no diff)."""
    return json.dumps({**contract, "generated_by": command}, indent=1, sort_keys=True) + "\n"


def load_contract(path: str | Path = CONTRACT_FILE) -> dict[str, Any]:
    return json.loads(Path(path).read_text())
