"""What multi-rank runs need around the transformations: FSDP2 sharding and its pre-flight, the Accelerate plugin,
weight loading and saving, sharded checkpoints read without running code, and one rank's error ending every rank.
"""
