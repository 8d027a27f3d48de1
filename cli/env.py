"""sparsekit env: versions, the GPU, and one line on whether the sparse kernels can run here."""
from __future__ import annotations

import typer

from sparsekit.cli.common import JSON_OPTION, console, emit_json, handle_errors

HELP = ("Show the installed versions, the GPU, and whether the sparse GPU kernels can run here "
        "(compiles and runs one small kernel), with what to install if not.\n\nExample: sparsekit env")


def register(app: typer.Typer) -> None:
    app.command("env", help=HELP)(env_cmd)


@handle_errors
def env_cmd(json_out: bool = JSON_OPTION):
    from sparsekit.evaluation.environment import environment_report

    report = environment_report()
    if json_out:
        emit_json(report)
        return
    console.print(f"sparsekit {report['sparsekit']}, Python {report['python']}", highlight=False)
    pkgs = ", ".join(f"{k} {v}" for k, v in report["packages"].items() if v)
    missing = [k for k, v in report["packages"].items() if not v]
    console.print(pkgs + (f" (not installed: {', '.join(missing)})" if missing else ""), highlight=False)
    console.print(f"GPU: {report['gpu'] or 'none visible to torch'}"
                  + (f" (torch built for CUDA {report['torch_cuda']})" if report["torch_cuda"] else ""), highlight=False)
    mem = report.get("gpu_memory")
    if mem:
        rate = f"{mem['gbps']} GB/s" if mem["gbps"] else "bandwidth not reported"
        plans = "fast-memory (H200-measured)" if mem["fast_memory_plans"] else "default (H100-measured)"
        console.print(f"GPU memory: {rate}; 2:4 kernels take the {plans} plans (SPARSEKIT_FAST_MEMORY sets them)",
                      highlight=False)
    console.print(report["kernels"]["line"], highlight=False, soft_wrap=True, markup=False)
