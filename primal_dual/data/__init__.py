"""Data sets and the input pipeline.

Modules are imported on demand (TFDS, grain and JAX are slow to import):

* ``uea``: UEA multivariate archive (`.ts` reading, preprocessing; pure NumPy).
* ``listops``: the seeded ListOps generator.
* ``builders``: TFDS builders (array_record, read without TensorFlow) and their sources
  (``uea_sources``, ``uea_info``, ``listops_sources``).
* ``sources``: the source contract (``Source``, ``BatchSource``) and the shared wrappers
  (``DecodedSource``, ``SubsetSource``, ``ArraySource``, ``GeneratedSource``).
* ``generated``: counter-based streams of the generated tasks (``sraven``, ``logic``).
* ``pipeline``: ``make_loader`` (checkpointable grain iterator) and ``iterate_eval``.
"""
