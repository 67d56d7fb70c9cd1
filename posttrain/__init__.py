"""The ``posttrain`` command line (:mod:`posttrain.cli`): the top of the import layering."""
