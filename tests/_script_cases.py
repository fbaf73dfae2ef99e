"""Runs one experiment script's ``main`` on several command lines in one process, as
``python SCRIPT ARGS...`` would, for tests whose command lines all fail before anything
compiles (tests/test_bad_input.py): one Python and JAX start-up for all of them.

    python tests/_script_cases.py SCRIPT CASES.json OUT.json

``CASES.json`` is ``[{"name": ..., "args": [...], "cwd": ...}, ...]``; ``OUT.json`` gets
``{name: {"returncode": int, "stderr": str}}``. Each case parses its flags afresh (every flag
back at its default first) and runs the script's ``main`` as ``absl.app.run`` does, with the
old flag spellings rewritten (``rljax.cli``); its exit status is ``main``'s ``SystemExit``
(1 for a flag absl refuses or an uncaught exception, whose traceback is in its stderr).
"""

import contextlib
import io
import json
import os
import runpy
import sys
import traceback


def main():
  script, cases_path, out_path = sys.argv[1:4]
  with open(cases_path, encoding="utf-8") as f:
    cases = json.load(f)
  sys.argv = [script]
  module = runpy.run_path(script, run_name="rljax_script_cases")
  from absl import flags

  from rljax import cli
  from rljax.alignment import flags as alignment_flags

  values = flags.FLAGS
  results = {}
  for case in cases:
    values.unparse_flags()
    err = io.StringIO()
    os.chdir(case["cwd"])
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
      try:
        argv = values(cli.rewrite_deprecated([script, *case["args"]],
                                             alignment_flags.DEPRECATED_ALIASES))
        module["main"](argv)
        code = 0
      except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
      except flags.Error as e:
        print(f"FATAL Flags parsing error: {e}", file=sys.stderr)
        code = 1
      except Exception:  # noqa: BLE001 - reported as the process would
        traceback.print_exc()
        code = 1
    results[case["name"]] = {"returncode": code, "stderr": err.getvalue()}
  with open(out_path, "w", encoding="utf-8") as f:
    json.dump(results, f)


if __name__ == "__main__":
  main()
