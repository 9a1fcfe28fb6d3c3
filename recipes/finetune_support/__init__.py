"""What recipes/finetune.py is built from, beyond the job itself: the flags and their checks, the
data, the model, the crash-safe output directory and its checkpoints. The script imports these
(Python puts its folder on ``sys.path`` under ``python``, ``accelerate launch`` and ``torchrun``); the
library never does.

    common.py      RecipeError (a bad input: one message, exit 2), the sharding routes
    faults.py      the test-only fault hook (HF_MEMSTACK_RECIPE_TEST_HOOK), in one marked place
    config.py      FinetuneConfig (every flag) and its reader: defaults <- --config file <- flags
    checks.py      check_config: every problem a config can have, before anything is loaded
    data.py        read, check, tokenize, pack and collate the rows
    model.py       the tokenizer, the model, the policy and the sharding route
    run_dir.py     the output directory: manifest, atomic writes, checkpoint listing, the output plan
    checkpoint.py  save / load a resumable checkpoint (Accelerate's state + the run's), commit the output
"""
