"""Everything that crosses sites: peer service, cross-site all-reduce, codecs, strategies."""
