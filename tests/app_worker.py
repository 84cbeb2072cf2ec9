"""Run under torchrun by tests/test_data_parallel.py, test_hf.py and test_run_dir.py: the whole app
(`main.main`, exactly what `torchrun main.py ...` runs) once per `--app "OVERRIDES"`, several runs
in ONE launch (imports cost 7-9 s per launch). The process group is kept between runs
(main(keep_process_group=True); init_distributed reuses the live group). Rank 0 writes each run's
exit code to OUT/exit_codes.json."""
from harness import run_apps, run_worker


def body(args) -> None:
    run_apps(args.app, args.out / "exit_codes.json")


if __name__ == "__main__":
    run_worker(body)
