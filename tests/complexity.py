"""`make lint`: no function of the package over radon's cyclomatic complexity 15.

ruff's mccabe counts a boolean chain or an inline conditional as nothing; radon counts them, so
rules hidden in expressions show. Prints each function over the limit, and fails when there is one.
"""

from __future__ import annotations

import sys
from pathlib import Path

from radon.complexity import cc_visit

LIMIT = 15


def main() -> int:
    over = []
    root = Path(__file__).resolve().parents[1]
    for path in sorted((root / "extractor").rglob("*.py")):
        for block in cc_visit(path.read_text()):
            for item in [block, *getattr(block, "closures", [])]:
                if item.complexity > LIMIT and type(item).__name__ == "Function":
                    over.append(f"{path.relative_to(root)}:{item.lineno} {item.fullname} {item.complexity}")
    for line in over:
        print(line)
    if over:
        print(f"{len(over)} functions over radon complexity {LIMIT}: split them into named steps")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
