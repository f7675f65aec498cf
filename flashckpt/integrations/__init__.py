"""Flash checkpoints for the training loops people run, in each framework's own idiom.

One module per framework, each imported only when used (``import flashckpt`` never imports a
framework, and the core package does not depend on any):

- :mod:`flashckpt.integrations.huggingface`: ``Trainer(..., callbacks=[FlashCheckpoint(...)])``;
- :mod:`flashckpt.integrations.lightning`: ``lightning.pytorch.Trainer(...,
  callbacks=[FlashCheckpoint(...)])``;
- :mod:`flashckpt.integrations.torchtitan`: ``FlashCheckpointManager(trainer.checkpointer, ...)``
  in place of torchtitan's ``CheckpointManager``.

Each snapshots the whole training state the framework keeps (model, optimizer, LR schedule, the
loop's own counters and logs, RNGs, the data position) into shared memory every N steps, and a
run restarted with the same command resumes from the newest snapshot in memory or storage.
"""
