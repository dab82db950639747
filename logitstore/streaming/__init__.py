"""The stream from a store version to packed micro-batches (`logitstore.stream`): its options (spec),
the epoch order and sharding, batch assembly and the teacher targets it builds, store and mixed sources.
Imports the store and text rooms; never the trainer or the build."""
