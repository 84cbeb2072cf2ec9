"""Run under torchrun by tests/test_tp_pp.py.

`--case NAME "OVERRIDES"`: train K steps of TINY + overrides and record what parity needs
(testing.parity.run_steps): the dp-mean loss and gradient norm of every step, the first step's whole
gradients by name, the parameters, and the validation loss after the last step (Trainer.evaluate:
under pp it runs the schedule's forward-only pass and the loss comes from the last stage). Rank 0
saves OUT/NAME.pt.
`--app "OVERRIDES"`: the whole app (main.main, what `torchrun main.py ...` runs) in the same
launch; rank 0 writes the exit codes to OUT/app_exit_codes.json.
All cases and runs share one process group, so one launch pays the imports once."""
from harness import run_apps, run_worker
from testing.parity import save_cases


def body(args) -> None:
    save_cases(args.case, args.steps, args.out, evaluate=True)
    run_apps(args.app, args.out / "app_exit_codes.json")


if __name__ == "__main__":
    run_worker(body)
