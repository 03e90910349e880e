/* sampler.c: DistributedSampler index generation (placeholder until implemented). */
#include "common.h"
