"""`eagle3-hf` command lines for the tests, written as keyword options instead of long flag lists."""

from typing import Any


def argv(command: str, **options: Any) -> list[str]:
    """`[command, --flag value ...]` in the options' order: `max_steps=1` gives `--max-steps 1`, a list `--flag a b`,
    True a bare `--flag`."""
    out = [command]
    for name, value in options.items():
        out.append("--" + name.replace("_", "-"))
        if value is not True:
            out.extend(str(v) for v in (value if isinstance(value, (list, tuple)) else [value]))
    return out
