"""Lightning's and Fabric's objects: the one adapter of private names, the copies of Lightning, Fabric's saves,
loggers."""
