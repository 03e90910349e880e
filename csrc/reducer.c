/* reducer.c: gradient buckets (placeholder until implemented). */
#include "group.h"
