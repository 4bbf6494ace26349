"""The verdict of a sweep, by meaning: ``metrics`` (what a metric is), ``declared`` (the margins and the
declared questions), ``measures`` (what is measured per run), ``families`` (the paired contrasts, their
tests and families), ``words`` (the sentences and tables). Its figures are :mod:`normgeo.figures.verdict`."""
