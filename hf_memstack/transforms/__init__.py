"""What ``prepare_model`` applies to a model: each transformation with its check (may fail, touches
nothing), its apply (cannot fail on checked input) and its verify piece. A feature of several modules is
one folder, whose ``__init__`` lists its modules and its touch points outside the folder.

checkpointing/      activation checkpointing: ``ckpt``, ``ckpt:N``, ``ckpt:selective``, ``ckpt:offload``
precision/          autocast (``bf16``, ``fp16``) and the trained weights' dtype (``weights:bf16``)
loss_head/          the chunked loss over labelled tokens: ``loss:chunked``
optim/              the optimizer rungs: ``optim:8bit``, ``optim:in_backward``, BF16AdamW
quant/              4-bit base weights: ``quant:nf4``
sequence_parallel/  Ulysses sequence parallelism: ``sp:N`` (attention, exchanges, group, batch sharding)
tiled_mlp.py        each block's MLP over tiles of tokens: ``mlp:tiled``
compile.py          ``compile``, ``compile:regional``
fsdp.py             FSDP2's ``fully_shard``: ``fsdp``, ``fsdp:shard_grad_op``, ``fsdp:hybrid_shard``,
                    ``fsdp:offload``
packed_attention.py per-sample attention for packed rows
blocks.py           find the repeated transformer blocks of any model
_wrappers.py        the instance-level forward wrappers (autocast, checkpoint) checkpointing and precision share
_peft.py            PEFT's tuner layers seen by duck typing
"""
