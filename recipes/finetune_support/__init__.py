"""What recipes/finetune.py is built from: the job, the flags and their checks, the
data, the model, the crash-safe output directory and its checkpoints. The script imports these
(Python puts its folder on ``sys.path`` under ``python``, ``accelerate launch`` and ``torchrun``); the
library never does.

    common.py      RecipeError (a bad input: one message, exit 2), the sharding routes
    faults.py      the test-only fault hook (HF_MEMSTACK_RECIPE_TEST_HOOK), in one marked place
    flags.py       the flags, one dataclass per --help group (ModelArgs, DataArgs, ..., OutputArgs), and
                   FinetuneConfig holding them (cfg.train.lr); their flat form for files
    config.py      their reader: defaults <- --config file <- flags, every value's type checked
    checks.py      check_config: every problem a config can have, before anything is loaded
    rows.py        read and check one data file, whatever its format
    data.py        the splits and the task from the rows; tokenize, pack and collate them
    model.py       the tokenizer, the model, the policy and the sharding route
    accelerator.py the run's Accelerator and the settings the recipe relies on
    batching.py    the micro-batch and the accumulation steps (flag, finder, or a resumed run's)
    run_dir.py     the output directory: manifest, the output plan
    run_lock.py    one run at a time in an output directory (a flock on its recipe.lock)
    safe_paths.py  writes and removals there that never go through a symlink; names checked before use
    checkpoint_dirs.py  the step-N checkpoint folders: which count, their removal, the state they hold
    checkpoint.py  save / load a resumable checkpoint (Accelerate's state + the run's), commit the output
    job.py         Job (what train() and save() need), TrainerState, the main process's printer
    report.py      the closing line's loss summary and the memory picture
    stops.py       why a run stops early, said once: NaN, a full disk, SIGINT/SIGTERM; how to resume
"""
