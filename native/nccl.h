/* The NCCL 2.x application ABI, as pitstop needs it: written from the public API
 * (enum values, 128-byte unique id, opaque communicator, versioned ncclConfig_t).
 * Shared by the host NCCL (native/) and the shim (shim/), whose wrappers are
 * generated from the prototypes below (shim/gen_wrappers.py reads this file). */
#ifndef PITSTOP_NCCL_H
#define PITSTOP_NCCL_H
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define NCCL_MAJOR 2
#define NCCL_MINOR 29
#define NCCL_PATCH 0
#define NCCL_VERSION_CODE 22900
#define NCCL_UNIQUE_ID_BYTES 128
#define NCCL_SPLIT_NOCOLOR -1

typedef struct ncclComm *ncclComm_t;
typedef struct { char internal[NCCL_UNIQUE_ID_BYTES]; } ncclUniqueId;
typedef void *cudaStream_t; /* host NCCL ignores streams: every call completes before it returns */
typedef struct ncclWindow *ncclWindow_t;                      /* opaque here: only passed along */
typedef struct ncclDevCommRequirements ncclDevCommRequirements_t;
typedef struct ncclDevComm ncclDevComm_t;
typedef enum { ncclScalarDevice = 0, ncclScalarHostImmediate = 1 } ncclScalarResidence_t;
typedef struct ncclSimInfo_v22200 ncclSimInfo_t;             /* versioned like ncclConfig_t: only passed along */
typedef struct ncclWaitSignalDesc ncclWaitSignalDesc_t;      /* only passed along */
typedef struct ncclParamHandle *ncclParamHandle_t;
typedef enum { ncclStatGpuMemSuspend = 0, ncclStatGpuMemSuspended = 1, ncclStatGpuMemPersist = 2,
               ncclStatGpuMemTotal = 3 } ncclCommMemStat_t;

typedef enum {
  ncclSuccess = 0, ncclUnhandledCudaError = 1, ncclSystemError = 2, ncclInternalError = 3,
  ncclInvalidArgument = 4, ncclInvalidUsage = 5, ncclRemoteError = 6, ncclInProgress = 7, ncclNumResults = 8
} ncclResult_t;

typedef enum { ncclSum = 0, ncclProd = 1, ncclMax = 2, ncclMin = 3, ncclAvg = 4, ncclNumOps = 5 } ncclRedOp_t;

typedef enum {
  ncclInt8 = 0, ncclChar = 0, ncclUint8 = 1, ncclInt32 = 2, ncclInt = 2, ncclUint32 = 3, ncclInt64 = 4,
  ncclUint64 = 5, ncclFloat16 = 6, ncclHalf = 6, ncclFloat32 = 7, ncclFloat = 7, ncclFloat64 = 8,
  ncclDouble = 8, ncclBfloat16 = 9, ncclNumTypes = 10
} ncclDataType_t;

/* ncclConfig_t grows across NCCL releases; `size` says how much of it the caller has.
 * Readers must never look past `size` (NVIDIA/nccl#2347). */
typedef struct ncclConfig_v21700 {
  size_t size;
  unsigned int magic;
  unsigned int version;
  int blocking;
  int cgaClusterSize;
  int minCTAs;
  int maxCTAs;
  const char *netName;
  int splitShare;
} ncclConfig_t;

/* BEGIN API (one prototype per line; shim/gen_wrappers.py parses these, and says in its table how the
 * shim treats each).  Every call of NCCL 2.17 to 2.30's nccl.h, and the device API's host calls. */
ncclResult_t ncclGetVersion(int *version);
ncclResult_t ncclGetUniqueId(ncclUniqueId *uniqueId);
const char *ncclGetErrorString(ncclResult_t result);
const char *ncclGetLastError(ncclComm_t comm);
ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank);
ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank, ncclConfig_t *config);
ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t *newcomm, ncclConfig_t *config);
ncclResult_t ncclCommFinalize(ncclComm_t comm);
ncclResult_t ncclCommDestroy(ncclComm_t comm);
ncclResult_t ncclCommAbort(ncclComm_t comm);
ncclResult_t ncclCommCount(const ncclComm_t comm, int *count);
ncclResult_t ncclCommUserRank(const ncclComm_t comm, int *rank);
ncclResult_t ncclCommCuDevice(const ncclComm_t comm, int *device);
ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *asyncError);
ncclResult_t ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclBroadcast(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype, int root, ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclReduce(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype, ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclAllGather(const void *sendbuff, void *recvbuff, size_t sendcount, ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclReduceScatter(const void *sendbuff, void *recvbuff, size_t recvcount, ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclSend(const void *sendbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclRecv(void *recvbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclGroupStart(void);
ncclResult_t ncclGroupEnd(void);
/* Newer calls (NCCL 2.17-2.30; the table in docs/architecture.md says since when).  Of these, host
 * NCCL implements buffer registration and the PreMulSum reduction operators only: the shim
 * answers ncclInvalidUsage for a missing one. */
ncclResult_t ncclCommInitAll(ncclComm_t *comm, int ndev, const int *devlist);
ncclResult_t ncclCommInitRankScalable(ncclComm_t *newcomm, int nranks, int myrank, int nId, ncclUniqueId *commIds, ncclConfig_t *config);
ncclResult_t ncclCommShrink(ncclComm_t comm, int *excludeRanksList, int excludeRanksCount, ncclComm_t *newcomm, ncclConfig_t *config, int shrinkFlags);
ncclResult_t ncclCommGetUniqueId(ncclComm_t comm, ncclUniqueId *uniqueId);
ncclResult_t ncclCommGrow(ncclComm_t comm, int nRanks, const ncclUniqueId *uniqueId, int rank, ncclComm_t *newcomm, ncclConfig_t *config);
ncclResult_t ncclCommRevoke(ncclComm_t comm, int revokeFlags);
ncclResult_t ncclCommSuspend(ncclComm_t comm, int flags);
ncclResult_t ncclCommResume(ncclComm_t comm);
ncclResult_t ncclCommMemStats(ncclComm_t comm, ncclCommMemStat_t stat, uint64_t *value);
ncclResult_t ncclBcast(void *buff, size_t count, ncclDataType_t datatype, int root, ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclAlltoAll(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclGather(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype, int root, ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclScatter(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype, int root, ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclPutSignal(const void *localbuff, size_t count, ncclDataType_t datatype, int peer, ncclWindow_t peerWin, size_t peerWinOffset, int sigIdx, int ctx, unsigned int flags, ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclSignal(int peer, int sigIdx, int ctx, unsigned int flags, ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclWaitSignal(int nDesc, ncclWaitSignalDesc_t *signalDescs, ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclGroupSimulateEnd(ncclSimInfo_t *simInfo);
ncclResult_t ncclCommRegister(const ncclComm_t comm, void *buff, size_t size, void **handle);
ncclResult_t ncclCommDeregister(const ncclComm_t comm, void *handle);
ncclResult_t ncclCommWindowRegister(ncclComm_t comm, void *buff, size_t size, ncclWindow_t *win, int winFlags);
ncclResult_t ncclCommWindowDeregister(ncclComm_t comm, ncclWindow_t win);
ncclResult_t ncclWinGetUserPtr(ncclComm_t comm, ncclWindow_t win, void **outUserPtr);
ncclResult_t ncclRedOpCreatePreMulSum(ncclRedOp_t *op, void *scalar, ncclDataType_t datatype, ncclScalarResidence_t residence, ncclComm_t comm);
ncclResult_t ncclRedOpDestroy(ncclRedOp_t op, ncclComm_t comm);
ncclResult_t ncclDevCommCreate(ncclComm_t comm, const ncclDevCommRequirements_t *reqs, ncclDevComm_t *outDevComm);
ncclResult_t ncclDevCommDestroy(ncclComm_t comm, const ncclDevComm_t *devComm);
ncclResult_t ncclMemAlloc(void **ptr, size_t size);
ncclResult_t ncclMemFree(void *ptr);
void ncclResetDebugInit(void);
ncclResult_t ncclParamBind(ncclParamHandle_t *out, const char *key);
ncclResult_t ncclParamGetI8(ncclParamHandle_t h, int8_t *out);
ncclResult_t ncclParamGetI16(ncclParamHandle_t h, int16_t *out);
ncclResult_t ncclParamGetI32(ncclParamHandle_t h, int32_t *out);
ncclResult_t ncclParamGetI64(ncclParamHandle_t h, int64_t *out);
ncclResult_t ncclParamGetU8(ncclParamHandle_t h, uint8_t *out);
ncclResult_t ncclParamGetU16(ncclParamHandle_t h, uint16_t *out);
ncclResult_t ncclParamGetU32(ncclParamHandle_t h, uint32_t *out);
ncclResult_t ncclParamGetU64(ncclParamHandle_t h, uint64_t *out);
ncclResult_t ncclParamGetStr(ncclParamHandle_t h, const char **out);
ncclResult_t ncclParamGet(ncclParamHandle_t h, void *out, int maxLen, int *len);
ncclResult_t ncclParamGetParameter(const char *key, const char **value, int *valueLen);
ncclResult_t ncclParamGetAllParameterKeys(const char ***table, int *tableLen);
void ncclParamDumpAll(void);
/* END API */

#ifdef __cplusplus
}
#endif
#endif
