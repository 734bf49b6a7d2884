"""The command line: ``paged-sparse-attn backends | demo | bench | check``.

typer and rich (the ``cli`` extra) are imported inside ``build_app``, so importing this
module, or the package, never needs them. Every error the package raises on purpose
(``PagedSparseAttnError``) is printed as one line with its rule id, without
a traceback. Exit codes: 0 success; 1 a backend disagreed with the reference or failed (``demo``);
2 a usage error or an error line; ``check`` and ``bench`` exit with the code of what they ran.
"""

# No ``from __future__ import annotations``: typer reads the commands' annotations at runtime.

import functools
import json
import importlib
import math
import sys
from typing import Any, Callable, Dict, List, Optional

from . import __version__, registry
from ._types import Capabilities
from .errors import PagedSparseAttnError

__all__ = ["main", "build_app", "backends_info", "error_line"]

PROG = "paged-sparse-attn"
# Device features that decide what a GPU backend can run (shown even when absent).
KEY_FEATURES = ("shader-f16", "subgroup", "timestamp-query", "subgroup-matrix")
EXIT_FAILED = 1
EXIT_ERROR = 2


def error_line(exc: BaseException) -> str:
    """One line for an error: its message, with the rule id appended if the message lacks it."""
    msg = " ".join(str(exc).split()) or type(exc).__name__
    rule = getattr(exc, "rule", "")
    if rule and f"[{rule}]" not in msg:
        msg = f"{msg} [{rule}]"
    return f"error: {msg}"


def _jsonable(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)  # JSON has no inf/nan
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple, set, frozenset)):
        items = sorted(x) if isinstance(x, (set, frozenset)) else x
        return [_jsonable(v) for v in items]
    return x


def capabilities_dict(caps: Capabilities) -> Dict[str, Any]:
    """A backend's ``Capabilities`` as plain JSON-able data."""
    return {
        "device": caps.device,
        "dtypes": list(caps.dtypes),
        "max_head_dim": caps.max_head_dim,
        "max_page_size": caps.max_page_size,
        "max_block_size": caps.max_block_size,
        "device_arrays": caps.device_arrays,
        "deterministic": caps.deterministic,
        "features": sorted(caps.features),
        "limits": {str(k): v for k, v in dict(caps.limits).items()},
    }


def backends_info() -> Dict[str, Any]:
    """Every registered backend with its availability and, when available, its capabilities.

    Never raises: a backend that probes fine but fails to start is reported unavailable with
    the error.

    Returns
    -------
    dict
        ``{"default": name, "backends": [{"name", "available", "reason", "default",
        "capabilities"}]}``; ``capabilities`` is None for unavailable backends.
    """
    try:
        default = registry.get_backend(None)
    except PagedSparseAttnError:
        default = None
    rows = []
    for name, avail in registry.list_backends().items():
        row: Dict[str, Any] = {"name": name, "available": avail.ok, "reason": avail.reason,
                               "default": False, "capabilities": None}
        if avail.ok:
            try:
                be = registry.get_backend(name)
                row["capabilities"] = capabilities_dict(be.capabilities)
                row["default"] = be is default
            except Exception as exc:  # report it, never crash the listing
                row["available"] = False
                row["reason"] = f"failed to start: {type(exc).__name__}: {exc}"
        rows.append(row)
    return {"default": getattr(default, "name", None), "backends": rows}


def _limit(key: str, v: Any) -> str:
    """A limit's value, in KiB/MiB/GiB when it is a size in bytes (counts are left alone)."""
    if not isinstance(v, int) or isinstance(v, bool) or v < 1024 or not any(
            w in key.lower() for w in ("size", "bytes", "memory")):
        return str(v)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        v /= 1024
        if v < 1024 or unit == "TiB":
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return str(v)  # pragma: no cover


def _fmt(x: Optional[float], spec: str = ".2e") -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return format(x, spec)


class _CliError(Exception):
    """A one-line error of the command line itself (not of the library)."""


def build_app():  # -> typer.Typer
    """Build the typer application (imports typer and rich)."""
    import typer
    from rich.console import Console
    from rich.table import Table
    from typing import Annotated

    app = typer.Typer(
        name=PROG,
        help="Block-sparse attention over a paged KV cache: backends, an end-to-end demo, "
             "benchmarks and the conformance check for backends.",
        add_completion=False,
        no_args_is_help=True,
        pretty_exceptions_enable=False,
        context_settings={"help_option_names": ["-h", "--help"]},
    )

    def guarded(fn: Callable[..., Any]) -> Callable[..., Any]:
        """Turn the package's errors into one line on stderr and exit code 2."""
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except (PagedSparseAttnError, _CliError) as exc:
                typer.echo(error_line(exc), err=True)
                raise typer.Exit(EXIT_ERROR) from None
        return wrapper

    def version_cb(value: bool) -> None:
        if value:
            typer.echo(f"{PROG} {__version__}")
            raise typer.Exit()

    @app.callback()
    def _root(
        version: Annotated[Optional[bool], typer.Option(
            "--version", callback=version_cb, is_eager=True, help="Print the version and exit.")] = None,
    ) -> None:
        """Block-sparse attention over a paged KV cache, computed KV-outer."""

    # ---------------------------------------------------------------------------------- backends
    @app.command()
    @guarded
    def backends(
        as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
    ) -> None:
        """List every registered backend (built-in and plugins): availability, device, features, limits."""
        info = backends_info()
        if as_json:
            typer.echo(json.dumps(_jsonable(info), indent=2))
            return
        console = Console()
        table = Table(title="paged_sparse_attn backends", title_justify="left")
        for col in ("backend", "status", "device", "dtypes", "features", "limits"):
            table.add_column(col, overflow="fold")
        for row in info["backends"]:
            name = row["name"] + (" (default)" if row["default"] else "")
            caps = row["capabilities"]
            if not row["available"]:
                table.add_row(name, f"[red]unavailable[/]: {row['reason']}", "-", "-", "-", "-")
                continue
            feats = set(caps["features"])
            if feats or caps["limits"]:
                shown = list(KEY_FEATURES) + sorted(feats - set(KEY_FEATURES))
                features = "\n".join(f"{f} {'✓' if f in feats else '✗'}" for f in shown)
            else:
                features = "-"
            limits = [f"{k}: {_limit(k, v)}" for k, v in caps["limits"].items()]
            limits += [f"{k}: {caps[k]}" for k in ("max_head_dim", "max_page_size", "max_block_size")
                       if caps[k] is not None]
            table.add_row(name, f"[green]available[/]: {row['reason']}", caps["device"],
                          ", ".join(caps["dtypes"]), features, "\n".join(limits) or "-")
        console.print(table)

    # -------------------------------------------------------------------------------------- demo
    @app.command(help="Run a realistic paged, causal, block-sparse problem on the backends, checked "
                      "against the float64 dense reference (exit 1 if any disagrees).")
    @guarded
    def demo(
        seed: Annotated[int, typer.Option(help="Random seed: the same seed gives the same problem.")] = 0,
        backend: Annotated[Optional[List[str]], typer.Option(
            "--backend", "-b", help="Backend to run (repeatable; a name or module:factory). "
                                    "Default: the default backend and every available one.")] = None,
        seqs: Annotated[int, typer.Option(help="Sequences B.")] = 3,
        max_len: Annotated[int, typer.Option(help="Longest KV length L.")] = 1024,
        queries: Annotated[int, typer.Option(help="Packed queries Tq (all sequences).")] = 48,
        heads: Annotated[int, typer.Option(help="Query heads Hq.")] = 8,
        kv_heads: Annotated[int, typer.Option(help="KV heads Hkv (Hq % Hkv == 0).")] = 2,
        head_dim: Annotated[int, typer.Option(help="Head dimension D.")] = 64,
        page_size: Annotated[int, typer.Option(help="Page size S.")] = 16,
        block_size: Annotated[int, typer.Option(help="Block size BS (a multiple of S).")] = 64,
        topk: Annotated[int, typer.Option(help="Blocks per query and KV head.")] = 4,
        dtype: Annotated[str, typer.Option(help="float32 or float16 (q and caches).")] = "float32",
        repeat: Annotated[int, typer.Option(help="Timed runs per backend after the first.")] = 3,
        as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    ) -> None:
        """The end-to-end demo (see paged_sparse_attn.demo)."""
        from .demo import DemoSizes, run_demo, tolerance

        sizes = DemoSizes(seqs=seqs, max_len=max_len, queries=queries, q_heads=heads, kv_heads=kv_heads,
                          head_dim=head_dim, page_size=page_size, block_size=block_size, topk=topk, dtype=dtype)
        report = run_demo(sizes, seed=seed, backends=backend or None, repeat=repeat)
        if as_json:
            typer.echo(json.dumps(_jsonable(report.to_dict()), indent=2))
        else:
            _print_demo(Console(), Table, report, tolerance(sizes.dtype))
        if not report.ok:
            raise typer.Exit(EXIT_FAILED)

    # ------------------------------------------------------------------------------------- bench
    @app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    @guarded
    def bench(ctx: typer.Context) -> None:
        """Run the benchmarks; every option (--json, --plot, ...) is passed through to paged_sparse_attn.bench."""
        bench_mod = importlib.import_module("paged_sparse_attn.bench")  # a subpackage of this wheel
        rc = bench_mod.main(list(ctx.args))
        raise typer.Exit(int(rc or 0))

    # ------------------------------------------------------------------------------------- check
    @app.command(context_settings={"allow_extra_args": True},
                 help="Run the conformance property suite against a backend; exits with its code "
                      "(0 = conforms). Arguments after -- go to pytest.")
    @guarded
    def check(
        ctx: typer.Context,
        backend: Annotated[str, typer.Option(
            "--backend", "-b", help="A registered backend name or module:factory.")],
        profile: Annotated[Optional[str], typer.Option(
            help="Hypothesis profile of the suite: ci, dev or thorough (default: the suite's own).")] = None,
    ) -> None:
        """The conformance kit (paged_sparse_attn.testing.run_conformance) on one backend."""
        be = registry.get_backend(backend)  # fail early, in one line, if it cannot run here
        from .testing import run_conformance as run  # a subpackage of this wheel
        typer.echo(f"checking backend {backend!r} ({be.capabilities.device})", err=True)
        kwargs: Dict[str, Any] = {}
        if profile is not None:
            kwargs["profile"] = profile
        if ctx.args:
            kwargs["extra_args"] = list(ctx.args)
        rc = run(backend, **kwargs)
        raise typer.Exit(int(rc or 0))

    return app


def _print_demo(console: Any, Table: Any, report: Any, tol: float) -> None:
    """Render a ``DemoReport`` with rich."""
    s = report.sizes
    console.print(f"[bold]paged-sparse-attn demo[/] (seed {report.seed})")
    console.print(f"problem   B={s.seqs} sequences, L={report.lens}, T={report.queries_per_seq} (Tq={s.queries}), "
                  f"Hq={s.q_heads}, Hkv={s.kv_heads}, D={s.head_dim}, {s.dtype}, causal")
    console.print(f"cache     {report.num_pages} physical pages of {s.page_size} in scrambled order, "
                  f"{report.holes} unmapped holes; spare pages and tails past L hold NaN (never read, R10)")
    console.print(f"blocks    block {s.block_size}, top-{s.topk} per query and KV head: {report.selection}",
                  markup=False)
    console.print(f"sparsity  {report.attended} attended of {report.visible} causal-visible tokens "
                  f"({100 * report.density:.1f}%)")
    console.print(f"reference dense_reference (float64) in {report.reference_s:.2f} s; "
                  f"tolerance {tol:.3g} x max(1, |ref|) ({s.dtype})")
    table = Table(title_justify="left")
    for col in ("backend", "max |Δout|", "max |Δlse|", "time (ms)", "first (ms)", "attended/visible", "result"):
        table.add_column(col, justify="left" if col in ("backend", "result") else "right", overflow="fold")
    colour = {"ok": "green", "unsupported": "yellow", "mismatch": "red", "error": "red"}
    for r in report.results:
        table.add_row(r.name, _fmt(r.out_err), _fmt(r.lse_err), _fmt(r.time_ms, ".1f"), _fmt(r.first_ms, ".1f"),
                      f"{100 * report.density:.1f}%", f"[{colour[r.status]}]{r.status}[/]")
    console.print(table)
    for r in report.results:
        if r.message:
            console.print(f"{r.name}: {r.message}", markup=False)
    for name, why in report.skipped.items():
        console.print(f"skipped {name}: {why}", markup=False)
    bad = [r.name for r in report.results if r.failed]
    if bad:
        console.print(f"[red bold]FAILED[/]: {', '.join(bad)} disagree with the reference or failed")
    else:
        console.print(f"[green bold]OK[/]: {len(report.results)} backend(s) agree with the reference")


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of the ``paged-sparse-attn`` console script.

    Parameters
    ----------
    argv : list of str, optional
        Arguments without the program name; default ``sys.argv[1:]``.

    Returns
    -------
    int
        The exit code.
    """
    try:
        app = build_app()
    except ImportError as exc:
        print(f"error: the command line needs the 'cli' extra (typer, rich): "
              f"pip install 'paged_sparse_attn[cli]' ({exc})", file=sys.stderr)
        return EXIT_ERROR
    try:
        app(args=argv, prog_name=PROG, standalone_mode=True)
    except SystemExit as exc:
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else EXIT_ERROR)
    except KeyboardInterrupt:  # pragma: no cover - interactive
        print("error: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
