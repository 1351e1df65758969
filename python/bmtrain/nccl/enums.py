"""NCCL's public enum values (ncclDataType_t, ncclRedOp_t), as BMTrain's bmtrain.nccl.enums names them."""

# ncclDataType_t
ncclInt8 = 0
ncclChar = 0
ncclBool = 0
ncclUint8 = 1
ncclInt32 = 2
ncclInt = 2
ncclUint32 = 3
ncclInt64 = 4
ncclUint64 = 5
ncclFloat16 = 6
ncclHalf = 6
ncclFloat32 = 7
ncclFloat = 7
ncclFloat64 = 8
ncclDouble = 8
ncclBFloat16 = 9

# ncclRedOp_t
ncclSum = 0
ncclProd = 1
ncclMax = 2
ncclMin = 3
ncclAvg = 4
