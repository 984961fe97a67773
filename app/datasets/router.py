from fastapi import APIRouter, Response

from app.datasets.protocol import DatasetInfo, DatasetList, DatasetName, DatasetUpload
from app.deps import DatasetsDep, OwnerDep
from app.errors import DATASET_ERROR_RESPONSES

router = APIRouter(tags=["datasets"], responses=DATASET_ERROR_RESPONSES)


@router.post(
    "/v1/datasets", response_model=DatasetInfo, status_code=201, summary="Upload a dataset"
)
async def upload_dataset(
    request: DatasetUpload, datasets: DatasetsDep, owner: OwnerDep
) -> DatasetInfo:
    """JSONL rows, checked line by line (a bad line is refused by its number and field, and
    nothing is stored); the dataset then serves this key's environments and rollouts by name."""
    return await datasets.upload(request, owner)


@router.get("/v1/datasets", response_model=DatasetList, summary="List datasets")
async def list_datasets(datasets: DatasetsDep, owner: OwnerDep) -> DatasetList:
    return await datasets.list(owner)


@router.get("/v1/datasets/{name}", response_model=DatasetInfo, summary="One dataset")
async def get_dataset(name: DatasetName, datasets: DatasetsDep, owner: OwnerDep) -> DatasetInfo:
    return await datasets.get(name, owner)


@router.delete("/v1/datasets/{name}", status_code=204, summary="Delete a dataset")
async def delete_dataset(name: DatasetName, datasets: DatasetsDep, owner: OwnerDep) -> Response:
    await datasets.delete(name, owner)
    return Response(status_code=204)
