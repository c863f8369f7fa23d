"""The static model's ceiling beside the GB/s measured on a GPU: `python -m bench.static.join
STATIC_CSV BENCH_CSV` (both written by `python -m bench` into the same results folder).

One row per measured fused token_stats case whose variant the model covers (rows off; the model's
production shape, not necessarily the measured one): measured GB/s, the copy GB/s measured in the
same run, and the model's ceiling (instruction issue or the ex2 unit, whichever runs out first).
"""

import csv
import sys


def _key(row) -> tuple:
    return (row["op"], row["phase"], row["dtype"], str(row["ids_per_row"]), str(row["entropy"]).lower())


def beside_measured(static_rows, bench_rows) -> str:
    ceilings = {_key(row): row for row in static_rows if "rows" not in row["variant"].split()}
    lines = [f"{'case':<52} {'GB/s':>8} {'copy':>8} {'ceiling':>8} {'ins/el':>7}"]
    for row in bench_rows:
        if row["subject"] != "fused" or row["op"] != "token_stats" or _key(row) not in ceilings:
            continue
        model = ceilings[_key(row)]
        case = f"{row['phase']} {row['dtype']} T={row['tokens']} V={row['vocab']} J={row['ids_per_row']} H={row['entropy']}"
        ceiling = float(model["ceiling_tbps"]) * 1000
        instructions = float(model["instructions_per_element"])
        lines.append(f"{case:<52} {row['gbps'] or '-':>8} {row['copy_gbps'] or '-':>8} {ceiling:>8.0f} {instructions:>7.1f}")
    return "\n".join(lines)


def _read(path):
    with open(path, newline="") as file:
        return list(csv.DictReader(file))


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: python -m bench.static.join STATIC_CSV BENCH_CSV")
    print(beside_measured(_read(sys.argv[1]), _read(sys.argv[2])))
