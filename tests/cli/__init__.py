"""Conventions of the ``gpukv`` command and of the library: version, logging,
number formats, options, install hints."""
